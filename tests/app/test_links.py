"""The view in the URL (app.core.links): a reload or a shared link reopens the same prompt, settings
and page; a link's values are a visitor's input, read by type and bound."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from app.core import keys, links, settings
from tests.app.apptest import APP, TIMEOUT, messages, raised_nothing, start
from tests.app.test_app_interventions import chart_titles


def test_the_url_follows_the_view_and_leaves_defaults_out(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint)
    assert "prompt" not in at.query_params and "block" not in at.query_params  # a plain visit: a clean URL
    at.text_area(key="prompt").set_value("Anne had not seen Captain").run()
    at.button(key="run").click().run()
    at.selectbox(key="block").set_value(2).run()
    raised_nothing(at)
    assert at.query_params["prompt"] == "Anne had not seen Captain" and at.query_params["block"] == "2"


def test_a_link_reopens_the_same_prompt_block_and_attribution(app_checkpoint, monkeypatch):
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update({"prompt": "Anne had not seen Captain", "block": "1", "attr_position": "3", "gen_tokens": "0"})
    raised_nothing(at.run())
    assert at.text_area(key="prompt").value == "Anne had not seen Captain"
    assert at.session_state["trace_key"].prompt == "Anne had not seen Captain"  # traced on opening, as typed
    assert at.selectbox(key="block").value == 1
    raised_nothing(at.switch_page("views/attribution.py").run())
    assert at.selectbox(key="attr_position").value == 3
    assert at.query_params["attr_position"] == "3"


def test_a_link_reopens_the_contribution_graphs_edges(app_checkpoint, monkeypatch):
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update({"prompt": "Anne had not seen Captain", "attr_edges": "above a share", "attr_threshold": "0.33"})
    at.query_params["attr_top"] = "5"
    raised_nothing(at.run())
    raised_nothing(at.switch_page("views/attribution.py").run())
    raised_nothing(at.button(key="attr_flow_run").click().run())
    assert at.slider(key="attr_threshold").value == 0.33
    assert "attr_top" not in [w.key for w in at.number_input]  # the k field is not drawn
    assert any("edges with a share above 0.33" in t for t in chart_titles(at))
    assert (at.query_params["attr_edges"], at.query_params["attr_top"]) == ("above a share", "5")
    raised_nothing(at.button_group(key="attr_edges").set_value("top k per stream").run())
    assert at.number_input(key="attr_top").value == 5 and any("each stream's top 5 edges" in t for t in chart_titles(at))


@pytest.mark.parametrize(
    ("name", "value"),
    [("attr_top", "0"), ("attr_top", "٣"), ("attr_edges", "all"), ("attr_threshold", "inf"), ("attr_threshold", "0.9")],
)
def test_the_graphs_controls_read_by_the_same_rules(name, value):
    state: dict = {}
    fine = {"attr_top": 20, "attr_threshold": 0.01, "attr_edges": "top k per stream"}  # each at its bound
    assert links.restore(state, {**{k: str(v) for k, v in fine.items()}, name: value}) == [name]
    assert state == {links.LOADED: True, **{k: v for k, v in fine.items() if k != name}}


@pytest.mark.parametrize(
    ("name", "value"),
    [("block", "²"), ("block", "-1"), ("gen_top_p", "nan"), ("gen_tokens", "9" * 40), ("source", "upload"), ("chat", "yes")],
)
def test_a_link_value_that_does_not_read_is_dropped_and_named(app_checkpoint, monkeypatch, name, value):
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update({name: value, "prompt": "Anne had not seen"})
    raised_nothing(at.run())
    assert f"The link's {name} could not be read" in messages(at.warning)
    assert at.text_area(key="prompt").value == "Anne had not seen"  # the rest of the link still applies
    assert not at.error, messages(at.error)


def test_a_prompt_longer_than_the_field_takes_is_dropped():
    state: dict = {}
    assert links.restore(state, {"prompt": "x" * (keys.LONGEST + 1), "block": "3"}) == ["prompt"]
    assert state["block"] == 3 and "prompt" not in state
    assert links.restore(state, {"block": "4"}) == [] and state["block"] == 3  # read once per session
