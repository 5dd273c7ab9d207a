"""The sidebar's run settings, run headless with AppTest: the Chat turn toggle (the prompt framed as a
DeepSeek-V3.2 conversation turn, with the thinking marker; refused where the vocabulary lacks the
markers, as the command line's --chat is) and the note that a changed setting needs a new Trace."""

from __future__ import annotations

from streamlit.testing.v1 import AppTest

from app.core import settings
from app.core.traces import Chat
from tests.app.test_app import APP, TIMEOUT, messages, shown_entry
from tests.tracing.test_chat import chat_checkpoint  # noqa: F401  the fixture: the tiny checkpoint, its tokenizer with the markers
from tracing.chat import THINK, encode_chat
from tracing.tokenizer import Tokenizer

QUESTION = "What is sparse attention?"
STALE = "Changed since this trace"


def start(monkeypatch, checkpoint) -> AppTest:
    monkeypatch.setenv(settings.ENV_CHECKPOINT, str(checkpoint))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def trace(at: AppTest) -> AppTest:
    at.button(key="run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_a_chat_turn_frames_the_prompt_with_the_markers(chat_checkpoint, monkeypatch):  # noqa: F811
    at = start(monkeypatch, chat_checkpoint)
    assert not at.toggle(key="chat").disabled
    at.text_area(key="prompt").set_value(QUESTION)
    at.toggle(key="chat").set_value(True).run()
    assert STALE in messages(at.sidebar.caption)  # the shown trace is still the plain prompt's
    trace(at)
    assert not at.error, messages(at.error)
    entry = shown_entry(at)
    assert entry.key.chat == Chat(thinking=False) and "chat turn" in entry.origin
    tok = Tokenizer(chat_checkpoint)
    assert entry.trace.token_ids == encode_chat(tok, QUESTION)
    assert STALE not in messages(at.sidebar.caption)

    at.toggle(key="chat_thinking").set_value(True).run()
    trace(at)
    thinking = shown_entry(at).trace.token_ids
    assert thinking[-1] == tok.token_id(THINK) and thinking == encode_chat(tok, QUESTION, thinking=True)
    assert shown_entry(at).key.chat == Chat(thinking=True)

    at.toggle(key="chat").set_value(False).run()  # back to the text as typed
    trace(at)
    assert shown_entry(at).key.chat is None and shown_entry(at).trace.token_ids == tok.encode(QUESTION)


def test_a_vocabulary_without_the_markers_disables_the_chat_toggle(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint)
    assert at.toggle(key="chat").disabled and not at.toggle(key="chat").value
    assert "Chat turns need DeepSeek-V3.2's vocabulary" in messages(at.sidebar.caption)
    at.session_state["chat"] = True  # carried from a checkpoint that had the markers: turned off, not traced as a chat
    trace(at)
    assert not at.error and not at.toggle(key="chat").value and shown_entry(at).key.chat is None


def test_changed_generation_settings_say_a_new_trace_is_needed(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint)
    shown = at.session_state["trace_key"]
    assert STALE not in messages(at.sidebar.caption)

    at.number_input(key="gen_tokens").set_value(3).run()
    assert at.session_state["trace_key"] == shown  # not traced behind the user's back
    assert f"{STALE}: the generation settings" in messages(at.sidebar.caption)
    trace(at)
    assert shown_entry(at).key.generation.tokens == 3 and STALE not in messages(at.sidebar.caption)

    at.radio(key="gen_mode").set_value("sampled").run()  # same count, sampled: needs a new trace
    assert f"{STALE}: the generation settings" in messages(at.sidebar.caption)
    trace(at)
    assert STALE not in messages(at.sidebar.caption)  # no seed asked for: any drawn seed answers the request
    at.number_input(key="gen_seed").set_value(5).run()
    assert f"{STALE}: the generation settings" in messages(at.sidebar.caption)
    at.number_input(key="gen_temperature").set_value(0.0).run()  # a bad value: still not what is shown
    assert f"{STALE}: the generation settings" in messages(at.sidebar.caption) and not at.error

    at.number_input(key="gen_temperature").set_value(1.2)
    at.text_area(key="prompt").set_value("Another prompt entirely.").run()
    assert f"{STALE}: the prompt, the generation settings" in messages(at.sidebar.caption)
    trace(at)
    key = at.session_state["trace_key"]
    assert key.generation.sampling.seed == 5 and key.prompt == "Another prompt entirely."
    assert STALE not in messages(at.sidebar.caption)
