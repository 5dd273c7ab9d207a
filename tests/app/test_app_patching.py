"""The Patching page: a clean and a corrupt prompt of one length swept, heat maps per site, one
cell's patched run against the corrupt run, and its refusals."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from app.core import settings
from tests.app.apptest import messages, raised_nothing, start
from tests.app.test_app_interventions import chart_titles

PAGE = "views/patching.py"


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, app_checkpoint, PAGE)


def sweep(at: AppTest, clean: str, corrupt: str, sites: list[str], positions: str | None = None) -> AppTest:
    at.text_area(key="patch_clean").set_value(clean)
    at.text_area(key="patch_corrupt").set_value(corrupt)
    at.multiselect(key="patch_sites").set_value(sites)
    if positions is not None:
        at.text_input(key="patch_positions").set_value(positions)
    at.button(key="patch_run").click()
    return raised_nothing(at.run())


def test_a_sweep_draws_a_heat_map_per_site_and_compares_a_cell(app):
    # the last two positions: the one where the prompts differ and one before it, where nothing can change
    sweep(app, "Anne had not seen Captain", "Anne had not seen Colonel", ["resid_pre", "ffn_out", "heads"], "5:")
    assert not app.error, messages(app.error)
    header = messages(app.markdown[:1])  # the pair swept, not the sidebar's trace
    assert "7 tokens" in header and "clean “Anne had not seen Captain” → corrupt “Anne had not seen Colonel”" in header
    assert settings.DEFAULT_PROMPT not in messages(app.markdown)
    result = app.session_state["patch_result"]
    table, summary = result["table"], result["summary"]
    assert set(table["site"]) == {"resid_pre", "ffn_out", "heads"} and summary["differing_positions"] == [6]
    titles = chart_titles(app)
    for what in ("the stream entering the block", "the FFN update", "one head's output"):
        assert any(f"Patching {what}" in t for t in titles), titles
    assert set(table["position"]) == {5, 6} and (table.query("position == 5")["value"] == 0).all()
    assert (table.query("site == 'resid_pre' and position == 6")["value"] == 1.0).all()
    raised_nothing(app.selectbox(key="patch_cell").select_index(1).run())  # the cell that restored most
    assert not app.error, messages(app.error)
    assert any("Baseline vs intervened" in str(h.value) for h in app.subheader)


@pytest.mark.parametrize(
    ("clean", "corrupt", "message"),
    [
        ("Anne had not seen Captain", "Anne had seen Colonel", "the clean prompt has 7 tokens and the corrupt one 6"),
        ("Anne had not seen Captain", "", "The prompt is empty"),
    ],
)
def test_a_sweep_that_cannot_run_is_one_error(app, clean, corrupt, message):
    sweep(app, clean, corrupt, ["resid_pre"])
    assert message in messages(app.error) and "patch_result" not in app.session_state


@pytest.mark.parametrize("how", ["stop", "rerun"])
def test_a_stopped_sweep_keeps_the_last_result_and_says_where_it_stopped(app, monkeypatch, how):
    """Streamlit's Stop (nothing more is drawn in that run) and the bar's own Stop or any widget (the
    page reruns at once) end a sweep at its next cell: the page then shows the last sweep that ended,
    says at which cell the other stopped, and draws no bar."""
    from streamlit.runtime.scriptrunner import get_script_run_ctx
    from streamlit.runtime.scriptrunner_utils.script_requests import RerunData

    import app.topics.patching_runs as runs

    app.text_input(key="patch_positions").set_value("5:7")
    sweep(app, "Anne had not seen Captain", "Anne had not seen Colonel", ["resid_pre"])
    last = app.session_state["patch_result"]["table"]
    real = runs.sweep

    def stopped_at_cell_3(*args, on_cell, **kwargs):
        def on(i: int, n: int) -> None:
            if i == 2:
                ctx = get_script_run_ctx()
                if how == "stop":
                    ctx.script_requests.request_stop()
                else:
                    ctx.script_requests.request_rerun(RerunData(page_script_hash=ctx.page_script_hash))
            on_cell(i, n)

        return real(*args, on_cell=on, **kwargs)

    monkeypatch.setattr(runs, "sweep", stopped_at_cell_3)
    at = sweep(app, "Anne had not seen Captain", "Anne had not seen Colonel", ["resid_pre", "ffn_out"])
    if how == "stop":
        raised_nothing(at.run())
    assert "Stopped:** Cell 2 of 16." in messages(at.warning) and not at.get("progress"), messages(at.warning)
    assert at.session_state["patch_result"]["table"].equals(last)
    assert any("Patching the stream entering the block" in t for t in chart_titles(at))
