"""Generation in the app, run headless with AppTest on the bundled demo (or the tiny dev checkpoint
while assets/demo is absent): the sidebar's Generate control writes tokens through the decode path,
the trace is cached apart from the prompt's, the Generation page shows the coloured text and each
step's details, a seeded sample is the same every time, and bad values give one st.error."""

from __future__ import annotations

from dataclasses import replace

import pytest
from streamlit.testing.v1 import AppTest

from app.core import pages, settings
from app.core.models import open_model
from app.core.traces import describe_interventions, encode, store
from tests.app.test_app import APP, TIMEOUT, messages, open_cards, open_tab, shown_entry
from tests.app.test_app_interventions import chart_titles
from tracing.analyses.intervention_specs import from_spec
from tracing.runner import trace_tokens
from tracing.sampling import Sampling
from tracing.tables.frames import steps_table

PAGE = "views/generation.py"
PROMPT = "The lightning indexer chooses which earlier keys"


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    """The app on the Generation page, after its first run traced the default prompt."""
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    return checked(checked(AppTest.from_file(APP, default_timeout=TIMEOUT).run()).switch_page(PAGE).run())


def checked(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    return at


def generate(at: AppTest, n: int, prompt: str = PROMPT, sampled: dict | None = None) -> AppTest:
    """Ask the sidebar for ``n`` new tokens (greedy, or sampled with ``temperature``/``top_p``/``seed``) and trace."""
    at.text_area(key="prompt").set_value(prompt)
    at.number_input(key="gen_tokens").set_value(n)
    at.radio(key="gen_mode").set_value("sampled" if sampled else "greedy").run()
    for name, value in (sampled or {}).items():
        at.number_input(key=f"gen_{name}").set_value(value)
    return checked(at.button(key="run").click().run())


def page_html(at: AppTest) -> list[str]:
    """The bodies of the page's st.html elements (not main.py's script that fetches plotly.js)."""
    return [h.proto.body for h in at.get("html") if "data-prefetch" not in h.proto.body]


def test_a_prompt_only_trace_says_how_to_generate_and_shows_its_steps(app):
    assert not app.error, messages(app.error)
    assert "set **Generate** in the sidebar" in messages(app.info)
    assert not app.dataframe  # the table is drawn when its expander opens
    app.session_state["generation_steps_table"] = True
    frame = app.run().dataframe[0].value
    assert list(frame.columns[:5]) == ["position", "phase", "generated", "token_id", "token"]
    assert not frame["generated"].any() and len(frame) == shown_entry(app).trace.n_tokens
    assert app.get("plotly_chart")  # the probability plot
    assert open_cards(app, "generation").latex and app.code


def test_greedy_generation_shows_the_text_and_each_step(app):
    plain_key = app.session_state["trace_key"]
    generate(app, 6)
    assert not app.error, messages(app.error)
    key = app.session_state["trace_key"]
    assert key.generation is not None and key.generation.tokens == 6 and key.generation.sampling.greedy
    assert key.plain != plain_key and store().get(plain_key) is not None  # cached apart from the prompt's trace
    trace = shown_entry(app).trace
    info = trace.extra["generation"]
    start, n = info["start"], info["generated"]
    assert start == len(encode(open_model(key.checkpoint, key.dtype), PROMPT)) and 1 <= n <= 6
    assert trace.n_tokens == start + n and trace.prompt == PROMPT

    text = page_html(app)[0]
    assert text.count('class="generated-token"') == n and "hsl(" in text
    steps = steps_table(trace)
    written = steps[steps["generated"]]
    assert (written["alt1"] == written["token"]).all(), "greedy writes the most likely token"

    slider = app.select_slider(key="gen_step")
    assert slider.value == start and len(slider.options) == n
    assert f"Position **{start}**" in messages(app.markdown)
    views = {
        "Alternatives": ["ten most likely"],
        "Experts": ["Experts chosen at position"],
        "Indexer picks": ["indexer scores over the cache"],
        "Logit lens": ["Logit lens at position"],
        "As the text grows": ["as the text grows", "how far back"],
        "Probabilities": ["How likely each token was"],
    }
    for label, parts in views.items():  # each tab draws its own view, the step's ones under the step chooser
        titles = chart_titles(open_tab(app, "generation_tab", label))
        assert not app.exception and all(any(part in t for t in titles) for part in parts), (label, titles)
    assert "generated" in open_tab(app, "generation_tab", "Every step").dataframe[0].value

    last = start + n - 1
    open_tab(app, "generation_tab", "Logit lens")
    app.select_slider(key="gen_step").set_value(last).run()
    assert not app.exception and f"Position **{last}**" in messages(app.markdown)
    assert any(f"Logit lens at position {last - 1}" in t for t in chart_titles(app))
    open_tab(app, "generation_tab", "Indexer picks")
    assert app.select_slider(key="gen_step").value == last  # the chosen step holds across the step's views
    for block in range(trace.config.n_layers):
        app.selectbox(key="block").set_value(block).run()
        assert not app.exception, (block, [e.value for e in app.exception])
        assert any(f"Block {block}: indexer scores" in t for t in chart_titles(app)), block


def test_the_mtp_tab_shows_each_draft_and_the_acceptance(app):
    generate(app, 6)
    trace = shown_entry(app).trace
    at = open_tab(app, "generation_tab", "MTP drafts")
    assert not at.exception, [e.value for e in at.exception]
    if "mtp.topk_indices" not in trace:  # a checkpoint without the module says so
        assert trace.extra["mtp"] in messages(at.caption)
        return
    got = trace.extra["generation"]["mtp_acceptance"]
    assert f"{got['accepted']} of {got['drafts']} times" in messages(at.caption)
    assert any("MTP draft of each written token" in t for t in chart_titles(at))
    frame = at.dataframe[0].value
    start = trace.extra["generation"]["start"]
    assert list(frame["position"]) == list(range(start, trace.n_tokens))
    steps = steps_table(trace)
    assert list(frame["accepted"].fillna(False)) == list(steps["mtp_accepted"][start:].fillna(False))


def test_every_page_works_on_a_generated_trace(app):
    generate(app, 4)
    for page in pages.PAGES:
        app.switch_page(page.path).run()
        assert not app.exception, (page.name, [e.value for e in app.exception])
        assert not app.error, (page.name, messages(app.error))
    assert app.session_state["trace_key"].generation.tokens == 4


def test_a_seeded_sample_writes_the_same_tokens_every_time(app, app_checkpoint, monkeypatch):
    settings_ = {"temperature": 1.5, "top_p": 0.9, "seed": 7}
    generate(app, 8, sampled=settings_)
    assert not app.error, messages(app.error)
    key = app.session_state["trace_key"]
    assert key.generation.sampling == Sampling(1.5, 0.9, 7)
    first = shown_entry(app).trace
    assert first.extra["generation"]["seed"] == 7 and first.extra["generation"]["temperature"] == 1.5

    store.clear()  # a new store: the second session traces again rather than reading the first one's trace
    again = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    generate(again, 8, sampled=settings_)
    second = shown_entry(again).trace
    assert second is not first and second.token_ids == first.token_ids

    om = open_model(key.checkpoint, key.dtype)  # the same draw outside the app
    direct = trace_tokens(om.loaded.model, encode(om, PROMPT), record=["next.*"], generate=8, sampling=Sampling(1.5, 0.9, 7))
    assert direct.token_ids == first.token_ids

    generate(again, 8, sampled={"seed": None})  # no seed: one is drawn and recorded in the key
    assert again.session_state["trace_key"].generation.sampling.seed is not None


@pytest.mark.parametrize(
    ("tokens", "sampled", "message"),
    [
        (4, {"temperature": 0.0}, "Sampling needs a temperature above 0"),
        (4, {"temperature": 0.8, "top_p": 1.5}, "Top-p must be above 0 and at most 1"),
        (4, {"temperature": 0.8, "top_p": 0.0}, "Top-p must be above 0 and at most 1"),
        (None, None, "generate at most"),  # as many as the input allows, after a long prompt
    ],
)
def test_bad_generation_values_give_one_error(app, tokens, sampled, message):
    before = app.session_state["trace_key"]
    if tokens is None:
        tokens = app.number_input(key="gen_tokens").proto.max  # the app's limit: prompt and new tokens together
    generate(app, tokens, prompt=settings.DEFAULT_PROMPT, sampled=sampled)
    assert len(app.error) == 1 and message in messages(app.error), messages(app.error)
    assert app.session_state["trace_key"] == before
    generate(app, 3)  # the app stays usable
    assert not app.error and app.session_state["trace_key"].generation.tokens == 3


def test_interventions_generate_under_both_settings_and_show_where_the_texts_part(app):
    generate(app, 8)
    base = shown_entry(app)
    cfg = base.trace.config
    keep = cfg.n_activated_experts  # ablate all but k experts in every MoE block: the router has no choice left
    typed = ",".join(f"{b}:{e}" for b in range(cfg.n_layers) if cfg.is_moe(b) for e in range(cfg.n_routed_experts - keep))
    app.switch_page("views/interventions.py").run()
    app.text_input(key="iv_ablate_text").set_value(typed)
    app.button(key="iv_run").click().run()
    assert not app.exception, [e.value for e in app.exception]
    assert not app.error, messages(app.error)
    assert "Where the texts part" in [str(h.value) for h in app.subheader]
    texts = page_html(app)
    assert len(texts) == 2 and all('class="generated-token"' in t for t in texts)

    spec = app.session_state["iv_result"]["spec"]
    iv = store().get(replace(base.key, variant=describe_interventions(from_spec(spec)))).trace
    assert iv.extra["generation"]["requested"] == 8 and iv.extra["generation"]["start"] == base.trace.extra["generation"]["start"]
    start = iv.extra["generation"]["start"]
    common = min(iv.n_tokens, base.trace.n_tokens)  # a run that stopped early parts where it stopped
    ended = None if iv.n_tokens == base.trace.n_tokens else common
    parted = next((p for p in range(start, common) if iv.token_ids[p] != base.trace.token_ids[p]), ended)
    metric = {m.label: m.value for m in app.get("metric")}["First differing step"]
    if parted is None:
        assert metric == "none" and "Expert choices changed" in {m.label for m in app.get("metric")}
    else:
        assert metric == f"position {parted} (step {parted - start + 1})"
        assert "wrote different tokens from position" in messages(app.info)
        assert texts[1].count("outline:2px") == 1
