"""The Patching page: a clean and a corrupt prompt of one length swept, heat maps per site, one
cell's patched run against the corrupt run, and its refusals."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from tests.app.apptest import messages, raised_nothing, start
from tests.app.test_app_interventions import chart_titles

PAGE = "views/patching.py"


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, app_checkpoint, PAGE)


def sweep(at: AppTest, clean: str, corrupt: str, sites: list[str]) -> AppTest:
    at.text_area(key="patch_clean").set_value(clean)
    at.text_area(key="patch_corrupt").set_value(corrupt)
    at.multiselect(key="patch_sites").set_value(sites)
    at.button(key="patch_run").click()
    return raised_nothing(at.run())


def test_a_sweep_draws_a_heat_map_per_site_and_compares_a_cell(app):
    sweep(app, "Anne had not seen Captain", "Anne had not seen Colonel", ["resid_pre", "ffn_out", "heads"])
    assert not app.error, messages(app.error)
    result = app.session_state["patch_result"]
    table, summary = result["table"], result["summary"]
    assert set(table["site"]) == {"resid_pre", "ffn_out", "heads"} and summary["differing_positions"] == [6]
    titles = chart_titles(app)
    for what in ("the stream entering the block", "the FFN update", "one head's output"):
        assert any(f"Patching {what}" in t for t in titles), titles
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
