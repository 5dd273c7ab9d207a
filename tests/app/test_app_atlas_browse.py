"""Browsing the atlas in the app, run headless with AppTest on the demo and its bundled atlas: the
Experts table and its search, the token search, the Router page's atlas expert marked in the
prompt, and the Attention page's sinks of this prompt (the trace's sinks table), each against its source."""

from __future__ import annotations

import base64
import json
import re
from dataclasses import replace

import numpy as np
import pytest

from app.topics import atlas as topic
from app.topics.tokens import show_token
from tests.app.apptest import messages, raised_nothing, start
from tests.app.test_app import open_tab, shown_entry, trace_prompt
from tracing.atlas import read_atlas
from tracing.atlas.tables import experts_table, token_routes

pytestmark = pytest.mark.skipif(not (topic.BUNDLED / "summary.json").is_file(), reason="assets/demo_atlas is not built")
LONG = " ".join(["It is a truth universally acknowledged, that a single man in possession of a good fortune."] * 5)


@pytest.fixture(scope="module")
def bundled():
    return read_atlas(topic.BUNDLED)


def show(at, section: str):
    return raised_nothing(at.button_group(key="atlas_section").set_value(section).run())


def test_the_experts_table_lists_every_expert_and_its_search_filters_the_rows(app_checkpoint, monkeypatch, bundled):
    at = show(start(monkeypatch, app_checkpoint, "views/atlas.py"), "Experts")
    frame = at.dataframe[0].value
    want = experts_table(bundled.tables)
    assert list(zip(frame["block"], frame["expert"], strict=True)) == list(zip(want["block"], want["expert"], strict=True))
    assert frame["count"].tolist() == want["count"].tolist() and len(frame) == 3 * bundled.summary["n_routed_experts"]
    shown = [" ".join(show_token(t, html_escape=False) for t in ts) for ts in want["top_tokens"]]
    assert [" ".join(s.split("  ")) for s in frame["most_specific_tokens"]] == shown
    assert any(b.proto.label == "CSV" for b in at.get("download_button"))

    at.text_input(key="atlas_search").set_value("7").run()
    found = raised_nothing(at).dataframe[0].value
    hit = (want["block"] == 7) | (want["expert"] == 7) | want["top_tokens"].map(lambda ts: any("7" in t for t in ts))
    rows = list(zip(want[hit]["block"], want[hit]["expert"], strict=True))
    assert list(zip(found["block"], found["expert"], strict=True)) == rows and 3 <= len(found) < len(frame)
    at.text_input(key="atlas_search").set_value("no token holds this").run()
    assert raised_nothing(at).dataframe[0].value.empty and "0 experts" in messages(at.caption)


def test_token_search_lists_the_experts_that_took_it(app_checkpoint, monkeypatch, bundled):
    at = show(start(monkeypatch, app_checkpoint, "views/atlas.py"), "Token search")
    table = bundled.tables["token_experts"]
    common = table.sort_values("occurrences").iloc[-1]
    at.text_input(key="atlas_token").set_value(common["token"]).run()
    got = raised_nothing(at).dataframe[0].value
    want = token_routes(bundled.tables, int(common["token_id"]))
    assert got["block"].tolist() == want["block"].tolist() and got["expert"].tolist() == want["expert"].tolist()
    assert got["count"].tolist() == want["count"].tolist()
    assert f"seen {int(common['occurrences']):,} times" in messages(at.markdown)
    assert at.get("plotly_chart")

    at.text_input(key="atlas_token").set_value(str(int(common["token_id"]))).run()  # its id finds it too
    assert raised_nothing(at).dataframe[0].value["count"].tolist() == want["count"].tolist()
    at.text_input(key="atlas_token").set_value("qqqzzz<b>").run()
    assert not raised_nothing(at).dataframe and "is not in the atlas" in messages(at.info)
    assert len(at.info) == 1


def test_the_router_page_marks_exactly_the_tokens_routed_to_the_atlas_expert(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint)
    trace_prompt(at, "Tags <b>such</b> & such: it is a truth.")
    at.session_state["block"] = 2
    raised_nothing(at.switch_page("views/router.py").run())
    open_tab(at, "router_tab", "Atlas expert")
    raised_nothing(at)
    trace = shown_entry(at).trace
    chosen = trace.site(2, "ffn.gate.topk_indices").numpy()  # (T, k)
    busiest = int(np.argmax(np.bincount(chosen.ravel(), minlength=trace.config.n_routed_experts)))
    box = at.selectbox(key="router_atlas_expert_2")
    assert box.value == busiest

    def marked() -> tuple[list[int], str]:
        body = next(h.proto.body for h in at.get("html") if "data-position" in h.proto.body)
        return [int(p) for p in re.findall(r'class="routed-token" data-position="(\d+)"', body)], body

    for expert in (busiest, (busiest + 1) % trace.config.n_routed_experts):
        raised_nothing(at.selectbox(key="router_atlas_expert_2").set_value(expert).run())
        positions, body = marked()
        assert positions == np.flatnonzero((chosen == expert).any(axis=1)).tolist()
        assert "<b>" not in body and "&lt;" in body  # the prompt's tags drawn as text
        assert "In the atlas" in messages(at.markdown) and len(at.dataframe[0].value) > 0


def test_the_router_page_without_an_atlas_of_this_model_says_how_to_build_one(app_checkpoint, monkeypatch, bundled):
    at = start(monkeypatch, app_checkpoint)
    other = replace(bundled, summary={**bundled.summary, "config": {**bundled.summary["config"], "n_routed_experts": 7}})
    at.session_state["atlas_opened"] = other
    at.session_state["block"] = 1
    raised_nothing(at.switch_page("views/router.py").run())
    open_tab(at, "router_tab", "Atlas expert")
    assert "python -m tracing atlas" in messages(raised_nothing(at).info) and not at.get("html")[1:]


def test_the_attention_page_counts_this_prompts_sinks(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint)
    trace_prompt(at, LONG)
    raised_nothing(at.switch_page("views/attention.py").run())
    open_tab(at, "attention_tab", "Sinks")
    frame = raised_nothing(at).dataframe[0].value
    trace = shown_entry(at).trace
    k = trace.config.index_topk
    assert trace.n_tokens > k
    want = trace.tables()["sinks"]  # its recount: tests/tracing/test_sinks.py
    assert frame[["block", "position", "kept", "queries"]].equals(want[["block", "position", "kept", "queries"]])
    assert frame["token"].tolist() == want["token"].tolist() and len(frame) == trace.config.n_layers * (trace.n_tokens - k)
    heat = next(json.loads(c.proto.spec) for c in at.get("plotly_chart") if "Keys kept from afar" in c.proto.spec)
    grid = want.pivot(index="block", columns="position", values="share").to_numpy()  # (blocks, S')
    z = heat["data"][0]["z"]  # plotly's typed array: base64 bytes of a dtype and shape
    shown = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape([int(d) for d in z["shape"].split(",")])
    np.testing.assert_allclose(shown, grid)

    trace_prompt(at, "It is a truth.")
    raised_nothing(at.switch_page("views/attention.py").run())
    open_tab(at, "attention_tab", "Sinks")
    assert shown_entry(at).trace.n_tokens <= k and not raised_nothing(at).dataframe
    assert "No query had to choose" in messages(at.info)
