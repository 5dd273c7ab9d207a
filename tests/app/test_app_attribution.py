"""The Attribution page, run headless with AppTest on the bundled demo (or the tiny dev checkpoint while
assets/demo is absent): it attributes the last position's top prediction on opening, follows the
position, target and contrast pickers and the block, draws the contribution graph on its button
(edges thinning as the threshold rises), shows a trace file's recorded attribution with no model,
and the component cards link to it."""

from __future__ import annotations

import pytest
from streamlit.testing.v1 import AppTest

from app.core import settings
from app.core.models import open_model
from app.core.traces import TraceKey, store
from app.topics import attribution as topic
from app.topics.graph_nodes import Node
from tests.app.test_app import APP, TIMEOUT, messages, shown_entry
from tests.app.test_app_generation import checked as generation_checked
from tests.app.test_app_generation import generate
from tests.app.test_app_interventions import chart_titles
from tracing.analyses.attribution import AttributionRequest, removable
from tracing.runner import trace_tokens

PAGE = "views/attribution.py"


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    """The app on the Attribution page, after its first run traced the default prompt."""
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    first = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    return checked(checked(first).switch_page(PAGE).run())


def checked(at: AppTest) -> AppTest:
    """The app after a run that raised nothing and showed no error."""
    assert not at.error, messages(at.error)
    return generation_checked(at)


def attributed_entry(at: AppTest, flow: bool = False):
    """The store's attributed trace for the pickers' current values."""
    plain = at.session_state["trace_key"].plain
    contrast = at.selectbox(key="attr_contrast").value
    position, target = at.selectbox(key="attr_position").value, at.selectbox(key="attr_target").value
    request = AttributionRequest(position, target, None if contrast < 0 else contrast)
    entry = store().get(TraceKey(**{**plain.__dict__, "variant": topic.variant(request, flow)}))
    assert entry is not None, request
    return entry


def coloured_prompt(at: AppTest) -> str:
    """The page's prompt coloured by what each token brought (HTML)."""
    return next(h.proto.body for h in at.get("html") if "attributed-token" in h.proto.body)


def test_opening_attributes_the_last_positions_top_prediction(app):
    base = shown_entry(app).trace
    last = base.n_tokens - 1
    assert app.selectbox(key="attr_position").value == last
    top = int(base["next.topk_indices"][last, 0])
    assert app.selectbox(key="attr_target").value == top and app.selectbox(key="attr_contrast").value == -1
    trace = attributed_entry(app).trace
    assert trace.extra["attribution"] == {"position": last, "target": top, "contrast": None}
    assert float(trace["attribution.total"][0]) == pytest.approx(float(base["logits.last"][top]), abs=1e-6)
    assert f"At position **{last}**" in messages(app.markdown)
    titles = chart_titles(app)
    for part in ("The largest parts of", "Each block's parts", "each head's part", "the experts' parts", "the dropped keys"):
        assert any(part in t for t in titles), (part, titles)
    dropped = trace.site(0, "attn.attribution_dropped")  # the default prompt is shorter than index_topk: nothing dropped
    assert dropped is not None and (not dropped.any() or base.n_tokens > base.config.index_topk)
    prompt = coloured_prompt(app)
    assert prompt.count('class="attributed-token"') == last + 1 and "outline:2px" in prompt
    assert app.button(key="attr_flow_run").label == "Compute the contribution graph"


def test_pickers_and_block_change_what_is_attributed(app):
    app.selectbox(key="attr_position").set_value(3).run()
    checked(app)
    top = shown_entry(app).trace["next.topk_indices"][3].tolist()
    assert len(app.selectbox(key="attr_target").options) == 10  # the position's top ten
    assert app.selectbox(key="attr_target").value == top[0]
    app.selectbox(key="attr_target").set_value(top[1]).run()
    app.selectbox(key="attr_contrast").set_value(top[0]).run()
    checked(app)
    trace = attributed_entry(app).trace
    assert trace.extra["attribution"] == {"position": 3, "target": top[1], "contrast": top[0]}
    assert "minus that of" in messages(app.markdown) and "At position **3**" in messages(app.markdown)
    assert coloured_prompt(app).count('class="attributed-token"') == 4  # the tokens up to the position
    cfg = trace.config
    moe = next(b for b in range(cfg.n_layers) if cfg.is_moe(b))
    app.selectbox(key="attr_block").set_value(moe).run()
    checked(app)
    assert any(f"Block {moe}: the experts' parts" in t for t in chart_titles(app))
    lens = app.dataframe[0].value  # each chosen expert's logit lens
    assert len(lens) == cfg.n_activated_experts and (lens["promotes"] != "").all() and (lens["suppresses"] != "").all()


def test_the_page_opens_on_the_largest_part_and_checks_it_at_its_position(app):
    trace = attributed_entry(app).trace
    value, key, block, index = max(removable(trace), key=lambda p: abs(p[0]))
    assert app.selectbox(key="attr_block").value == block  # not the sidebar's block 0
    first = app.button(key=f"attr_remove_{key}")
    position = trace.extra["attribution"]["position"]
    assert f"{block}:{index} at position {position}" in first.label
    app.number_input(key="attr_causal_n").set_value(3).run()
    app.button(key="attr_causal_run").click().run()
    checked(app)
    table = next(d.value for d in app.dataframe if "effect" in d.value.columns)
    assert len(table) == 3 and table["removed"].str.endswith(f"at position {position}").all()
    assert table.iloc[0]["attributed"] == pytest.approx(value, abs=1e-6)
    assert "Correlation of the attributed values and the measured effects" in messages(app.markdown)


def test_the_graph_is_drawn_on_request_and_thins_with_the_threshold(app):
    assert not any("Contribution graph into" in t for t in chart_titles(app))
    app.button(key="attr_flow_run").click().run()
    checked(app)
    assert any("Contribution graph into position" in t for t in chart_titles(app))
    trace = attributed_entry(app, flow=True).trace
    position = trace.extra["attribution"]["position"]
    low = topic.flow_graph(trace, position, 0.02)
    high = topic.flow_graph(trace, position, 0.3)
    assert 0 < len(high.edges) < len(low.edges)
    keys = low.edges[low.edges["kind"] == "attention"]
    for row in keys.itertuples():  # every attention edge runs along a key the indexer selected
        block = int(row.y0) // 2
        assert row.x0 in trace.site(block, "attn.indexer.topk_indices")[int(row.x1)].tolist()
    assert any("each stream's top 3 edges" in t for t in chart_titles(app))  # the default: each stream's largest
    # a click on a diamond reruns the page (the chart selects points) and opens that block's heads into the position
    (graph,) = [c for c in app.get("plotly_chart") if "Contribution graph into" in c.proto.spec]
    assert list(graph.proto.selection_mode) and graph.proto.id
    block = trace.config.n_layers - 1
    app.session_state["attr_node"] = Node("attention", block, position)
    checked(app.run())
    strongest = int(abs(trace.site(block, "attn.attribution")).argmax())
    assert app.selectbox(key="attr_node_pick").value == strongest
    assert f"Head {block}:{strongest} wrote **" in messages(app.markdown)
    app.session_state["attr_node"] = Node("ffn", block, position)
    checked(app.run())
    assert f"Expert {block}:" in messages(app.markdown) and "of the stream at position" in messages(app.markdown)
    app.session_state["attr_edges"] = "above a share"
    app.run()
    app.slider(key="attr_threshold").set_value(0.3).run()
    assert any("edges with a share above 0.3" in t for t in chart_titles(app))
    checked(app)
    app.selectbox(key="attr_position").set_value(2).run()  # another position keeps the graph asked for
    checked(app)
    assert any("Contribution graph into position 2" in t for t in chart_titles(app))


def test_a_generated_trace_is_attributed_at_its_last_position(app):
    generate(app, 3)
    checked(app)
    trace = shown_entry(app).trace
    assert trace.extra["generation"]["generated"] >= 1
    last = trace.n_tokens - 1
    assert app.selectbox(key="attr_position").value == last
    info = attributed_entry(app).trace.extra["attribution"]
    assert info["position"] == last and info["target"] == int(trace["next.topk_indices"][last, 0])


def test_a_trace_file_shows_its_recorded_attribution_without_a_model(app, tmp_path, monkeypatch):
    plain = shown_entry(app)
    model = open_model(plain.key.checkpoint, plain.key.dtype).loaded.model
    recorded = trace_tokens(model, plain.trace.token_ids, record="default,flow", attribution=AttributionRequest(position=4))
    without = plain.trace_bytes()
    monkeypatch.setenv(settings.ENV_CHECKPOINT, str(tmp_path / "no-model-here"))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    at.radio(key="source").set_value("upload").run()
    at.file_uploader(key="upload").set_value(("attributed.safetensors", recorded.to_bytes(), "application/octet-stream")).run()
    at.switch_page(PAGE).run()
    assert not at.exception and not at.error, messages(at.error)
    assert "shown as it was recorded" in messages(at.caption) and "At position **4**" in messages(at.markdown)
    assert any("Contribution graph into position 4" in t for t in chart_titles(at))
    at.file_uploader(key="upload").set_value(("plain.safetensors", without, "application/octet-stream")).run()
    at.switch_page(PAGE).run()
    assert not at.exception and "--attribute" in messages(at.info)


def test_component_cards_link_to_the_attribution(app):
    app.switch_page("views/anatomy.py").run()
    app.button_group(key="anatomy_component").set_value("all").run()
    links = [link.proto for link in app.get("page_link")]
    labels = [link.label for link in links]
    assert "Attribution: this block's heads (block 0)" in labels and "Attribution: the embedding's part" in labels
    assert {link.page for link in links} == {"attribution"}, {link.page for link in links}


def test_any_token_of_the_vocabulary_can_be_the_target(app, app_checkpoint):
    from tracing.cli.loading import resolve_checkpoint
    from tracing.tokenizer import Tokenizer

    (wentworth,) = Tokenizer(resolve_checkpoint(app_checkpoint)).encode(" Wentworth", add_bos=False)
    position = app.selectbox(key="attr_position").value
    plain = app.session_state["trace_key"].plain

    def attributed_to(target: int):
        request = AttributionRequest(position, target, None)
        return store().get(TraceKey(**{**plain.__dict__, "variant": topic.variant(request, False)}))

    assert wentworth not in topic.candidates(shown_entry(app).trace, position)  # not among the top ten
    app.text_input(key="attr_target_text").set_value(" Wentworth").run()
    checked(app)
    assert attributed_to(wentworth).trace.extra["attribution"]["target"] == wentworth
    app.text_input(key="attr_target_text").set_value("Wentworth").run()
    assert "is 2 tokens" in messages(app.error) and "' Wentworth' is one token" in messages(app.error)
    app.text_input(key="attr_target_text").set_value(str(wentworth)).run()
    checked(app)
