"""Hostile input to this round's browsing: the Atlas page's token search and Experts search, run
headless with AppTest on the demo and its bundled atlas. Every value is answered in one line or a
table, typed text is echoed as text (never markup) and bounded, and a token's text with a leading
space is that token, not an id."""

from __future__ import annotations

import pytest

from app.topics import atlas as topic
from tests.app.apptest import messages, raised_nothing, start
from tracing.atlas import read_atlas
from tracing.atlas.tables import find_token

pytestmark = pytest.mark.skipif(not (topic.BUNDLED / "summary.json").is_file(), reason="assets/demo_atlas is not built")
HOSTILE = {
    "markup": "<img src=x onerror=alert(1)> **x** [a](http://example.com) $x$",
    "control characters": "\x00\x07\x1b[31m",
    "a huge id": "9" * 40,
    "a negative id": "-5",
    "very long": "x" * 50_000,
}


@pytest.fixture(scope="module")
def bundled():
    return read_atlas(topic.BUNDLED)


def test_a_digit_token_with_its_leading_space_is_that_token_not_an_id(bundled):
    """The field asks for a token as the tokenizer writes it, a leading space included: ' 2' is a
    token of its own (not id 2), and digits alone are an id."""
    table = bundled.tables["token_experts"].drop_duplicates("token_id")
    spaced = table[table["token"].str.startswith(" ") & table["token"].str[1:].str.isdigit()].iloc[0]
    assert find_token(bundled.tables, spaced["token"]) == int(spaced["token_id"])
    assert int(spaced["token_id"]) != int(spaced["token"])
    some = int(table["token_id"].iloc[0])
    assert find_token(bundled.tables, str(some)) == some


@pytest.mark.parametrize("case", HOSTILE)
def test_the_token_search_answers_hostile_text_in_one_bounded_line(app_checkpoint, monkeypatch, case):
    at = start(monkeypatch, app_checkpoint, "views/atlas.py")
    raised_nothing(at.button_group(key="atlas_section").set_value("Token search").run())
    text = HOSTILE[case]
    raised_nothing(at.text_input(key="atlas_token").set_value(text).run())
    assert not at.error and len(at.info) == 1 and not at.dataframe
    line = messages(at.info)
    assert "is not in the atlas" in line and len(line) < 400, line[:200]
    if case == "markup":  # escaped for Markdown: drawn as the characters typed
        assert "\\*\\*x\\*\\*" in at.info[0].proto.body and "<img" not in at.info[0].proto.body.replace("\\<", "")


@pytest.mark.parametrize("case", HOSTILE)
def test_the_experts_search_takes_hostile_text(app_checkpoint, monkeypatch, case):
    at = start(monkeypatch, app_checkpoint, "views/atlas.py")
    raised_nothing(at.button_group(key="atlas_section").set_value("Experts").run())
    raised_nothing(at.text_input(key="atlas_search").set_value(HOSTILE[case]).run())
    assert at.dataframe[0].value.empty and "0 experts" in messages(at.caption)


def test_the_router_page_refuses_an_atlas_of_another_model(monkeypatch, tmp_path):
    """The bundled atlas counted the demo's experts: on the tiny model (another shape) the Router page's
    Atlas expert tab draws none of them and says, in one line, that no atlas of this model is open."""
    from tests.app.test_app import open_tab
    from tests.devcheckpoint import make_dev_checkpoint

    at = start(monkeypatch, str(make_dev_checkpoint(tmp_path / "tiny")))
    raised_nothing(at.switch_page("views/atlas.py").run())  # the bundled atlas, opened in this session
    at.session_state["block"] = 1
    raised_nothing(at.switch_page("views/router.py").run())
    open_tab(at, "router_tab", "Atlas expert")
    raised_nothing(at)
    assert "No atlas of this model is open" in messages(at.info)
    assert not [s for s in at.selectbox if str(s.key).startswith("router_atlas_expert")]
