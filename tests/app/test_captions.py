"""Each caption or title that names a mark promises something the figure draws: built from a real
trace, each figure is searched for the mark it names (the trace type, marker, text or shape), and a
figure too crowded for its cell text says so instead. And the attribution's scales: its parts on a
symmetric scale that marks a dominating one, its graph drawing each stream's largest edges."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from app import plots
from app.topics import attention, attribution, experts, interventions, model_map, residual, router
from app.topics.figures import COLORS, TICK_LIMIT, symmetric_range
from app.topics.tokens import position_labels
from model import TINY
from tracing import TraceRequest, run
from tracing.analyses.diff import diff_tables
from tracing.tables import tables
from tracing.tables.frames import NEAR_TIE

TOKENS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]  # more than TINY's index_topk (8): keys dropped
MOE = 1  # TINY's first MoE block


@pytest.fixture(scope="module")
def trace(tiny_model):
    return run(tiny_model, TraceRequest(token_ids=TOKENS, record=("all", "flow"), attribute=True))


@pytest.fixture(scope="module")
def long_trace(tiny_model):
    ids = [(7 * i + 3) % TINY.vocab_size for i in range(TICK_LIMIT + 5)]
    return run(tiny_model, TraceRequest(token_ids=ids, record=("all",)))


# the named entities plotly.js decodes in a label (svg_text_utils); any other would be drawn as typed
PLOTLY_ENTITIES = {"mu", "amp", "lt", "gt", "nbsp", "times", "plusmn", "deg"}


@pytest.mark.parametrize("token", [' "', "'s", "<b>x</b>", "a & b", '"quoted"'])
def test_a_token_label_reads_as_its_text_in_a_figure(token):
    import html
    import re

    from app.topics.tokens import show_token

    shown = show_token(token)
    assert "<" not in shown and not set(re.findall(r"&([a-z]+);", shown)) - PLOTLY_ENTITIES, shown
    assert html.unescape(shown) == show_token(token, html_escape=False)


def kind(fig, type_: str, name: str | None = None) -> list:
    return [t for t in fig.data if t.type == type_ and (name is None or t.name == name)]


def test_index_scores_mark_the_keys_the_title_names(trace):
    fig = plots.plot(trace, "index_scores", block=MOE)
    title = fig.layout.title.text
    (marks,) = kind(fig, "scatter")
    symbol = "x-thin-open" if "crossed" in title else "circle-open"
    assert ("crossed" in title or "circled" in title) and marks.marker.symbol == symbol and len(marks.x) > 0


def test_the_query_profile_greys_the_keys_the_indexer_dropped(trace):
    query = len(TOKENS) - 1
    df = attention.query_profile(trace, MOE, query)
    fig = attention.query_profile_figure(df, query, "x", MOE)
    assert "grey bars are keys the indexer dropped" in fig.layout.title.text
    colours = np.asarray(kind(fig, "bar")[0].marker.color)
    assert (colours[~df["selected"].to_numpy()] == "#C7C7C7").all() and (~df["selected"]).any()
    assert "#C7C7C7" not in colours[df["selected"].to_numpy()]


def test_router_scores_draw_group_lines_darkened_groups_and_circled_choices(trace):
    fig = plots.plot(trace, "router_scores", block=MOE)
    axis = fig.layout.xaxis.title.text
    assert "white lines: groups" in axis and "darkened: groups not chosen" in axis
    lines = [s for s in fig.layout.shapes if s.type == "line"]
    assert len(lines) == TINY.n_expert_groups - 1 and all(s.line.color == "white" for s in lines)
    (dark,) = [t for t in kind(fig, "heatmap") if t.name == "groups not chosen"]
    assert "rgba(0,0,0" in dark.colorscale[0][1] and np.isfinite(np.asarray(dark.z, dtype=float)).any()
    (chosen,) = kind(fig, "scatter", "chosen expert (size: weight)")
    assert chosen.marker.symbol == "circle-open" and len(chosen.x) == len(TOKENS) * TINY.n_activated_experts


def test_group_scores_box_the_chosen_groups(trace):
    r = router.routing(trace, MOE)
    fig = router.groups_figure(r, position_labels(trace))
    assert "chosen groups boxed" in fig.layout.title.text
    (boxes,) = kind(fig, "scatter", "chosen group")
    assert boxes.marker.symbol == "square-open" and len(boxes.x) == int(r.groups_chosen.sum())


def test_the_bias_figure_draws_its_panels_and_dotted_group_lines(trace):
    fig = router.bias_figure(router.bias_effect(trace, MOE), TINY.experts_per_group)
    assert "b (top)" in fig.layout.title.text and fig.layout.yaxis2.domain[0] > fig.layout.yaxis.domain[1]
    assert "dotted lines: groups" in fig.layout.xaxis.title.text
    assert fig.layout.shapes and all(s.line.dash == "dot" for s in fig.layout.shapes)


@pytest.mark.parametrize("tie", [False, True])
def test_margins_mark_the_near_ties_the_title_counts(trace, tie):
    frame = router.margins(tables(trace)["margins"], MOE)
    if tie:  # a near-tie at position 2, as a rounding could make one
        frame.loc[2, ["margin", "near_tie"]] = [0.0, True]
    fig = router.margins_figure(frame, position_labels(trace), MOE, NEAR_TIE)
    ties = int(frame["near_tie"].sum())
    marked = kind(fig, "scatter", "near-tie")
    assert f"({ties} near-tie" in fig.layout.title.text and "red ▲" in fig.layout.title.text
    assert (len(marked[0].x) if marked else 0) == ties
    if marked:  # red on a bar of another colour: the bars are grey
        assert marked[0].marker.symbol == "triangle-up" and marked[0].marker.color == COLORS["marker"]
        assert kind(fig, "bar")[0].marker.color != COLORS["marker"]


@pytest.mark.parametrize("long", [False, True])
def test_expert_weights_write_the_expert_only_where_the_title_says(trace, long_trace, long):
    shown = long_trace if long else trace
    fig = plots.plot(shown, "expert_weights", block=MOE)
    written = all(t.text is not None for t in kind(fig, "bar"))
    assert written != long
    assert ("the numbers: expert" in fig.layout.title.text) == written
    assert ("hover for the expert" in fig.layout.title.text) == long


@pytest.mark.parametrize("long", [False, True])
def test_the_logit_lens_writes_the_top_token_in_its_cells_only_when_it_says_so(trace, long_trace, long):
    shown = long_trace if long else trace
    fig = plots.plot(shown, "logit_lens")
    heat = kind(fig, "heatmap")[0]
    assert (heat.texttemplate == "%{text}") != long
    assert ("the top token in each cell" in fig.layout.title.text) != long
    assert (f"more than {TICK_LIMIT} positions: hover for the top token" in fig.layout.title.text) == long
    assert heat.hovertemplate and "top tokens" in heat.hovertemplate  # hover everywhere
    assert fig.layout.yaxis.dtick == 1  # every block's row named


def test_the_stream_norm_marks_no_cell_when_none_dominates(trace):
    fig = plots.plot(trace, "block_updates", block=0)  # a plain trace: no token beyond the scale
    assert "beyond the scale" not in fig.layout.title.text and not kind(fig, "scatter", "beyond the scale")


def test_the_experts_parts_write_the_token_each_promotes(trace):
    block = next(b for b in range(TINY.n_layers) if TINY.is_moe(b))
    fig = plots.plot(trace, "attribution_ffn", block=block)
    assert "text: the token each promotes most" in fig.layout.title.text
    bar = kind(fig, "bar")[0]
    experts_rows = [i for i, label in enumerate(bar.y) if label.startswith("expert")]
    assert experts_rows and all(bar.text[i] for i in experts_rows)


def test_the_update_sizes_draw_their_whiskers(trace):
    fig = residual.update_sizes_figure(residual.residual_grids(tables(trace)["residual"], trace.n_tokens))
    assert "whiskers the range" in fig.layout.title.text
    assert all(b.error_y.array is not None and b.error_y.arrayminus is not None for b in kind(fig, "bar"))


def test_the_model_map_colours_dense_and_moe_blocks_as_its_axis_says():
    fig = model_map.block_map_figure(TINY, model_map.params_by_block(TINY), 1)
    assert "teal: dense MLP" in fig.layout.xaxis.title.text and "red: MoE" in fig.layout.xaxis.title.text
    heat = kind(fig, "heatmap")[0]
    ffn = np.asarray(heat.z)[3]  # the FFN row: 2 a dense MLP, 3 a MoE, coloured by the scale's quarters
    colour = {2.0: COLORS["dense"], 3.0: COLORS["moe"]}
    assert [colour[v] for v in ffn] == [COLORS["moe"] if TINY.is_moe(b) else COLORS["dense"] for b in range(TINY.n_layers)]
    assert [heat.colorscale[i][1] for i in (4, 7)] == [COLORS["dense"], COLORS["moe"]]


@pytest.fixture(scope="module")
def diffed(tiny_model, trace):
    changed = run(tiny_model, TraceRequest(token_ids=TOKENS, record=("all",), interventions={"ablate": {MOE: [0, 1, 2, 3]}}))
    return diff_tables(trace, changed)


def test_the_diff_lens_names_the_new_token_in_changed_cells_and_every_block_row(diffed, trace):
    lc = interventions.lens_changes(diffed["predictions"], trace.n_tokens)
    fig = interventions.lens_changes_figure(lc, position_labels(trace))
    heat = kind(fig, "heatmap")[0]
    assert "the new token in each cell" in fig.layout.title.text and heat.texttemplate == "%{text}"
    text, changed = np.asarray(heat.text), np.asarray(heat.z) == 1
    assert changed.any() and (text[changed] != "").all() and (text[~changed] == "").all()
    assert fig.layout.yaxis.dtick == 1 and list(heat.y) == [f"block {i}" for i in lc.layers]


def test_the_diff_expert_load_crosses_out_the_ablated_experts(trace):
    before = experts.expert_tokens(trace, MOE)
    fig = interventions.expert_load_change_figure(before, before, (0, 1), MOE, TINY.experts_per_group, zeroed=(5,))
    assert "dotted lines: groups" in fig.layout.xaxis.title.text
    (crossed,) = kind(fig, "scatter", "ablated")
    (ringed,) = kind(fig, "scatter", "zeroed (chosen, writes nothing)")
    assert crossed.marker.symbol == "x" and list(crossed.x) == [0, 1]
    assert ringed.marker.symbol == "circle-open" and list(ringed.x) == [5]


def test_the_contribution_graph_draws_only_the_edges_its_title_names(flow_trace):
    traced = flow_trace
    position = traced.extra["attribution"]["position"]
    graph = attribution.flow_graph(traced, position, top=2)
    fig = attribution.flow_figure(graph, position_labels(traced), position, "each stream's top 2 edges")
    assert "each stream's top 2 edges; keys the indexer dropped never drawn" in fig.layout.title.text
    drawn = sum(sum(v is None for v in t.x) for t in kind(fig, "scatter") if t.mode == "lines")  # one gap per edge
    assert drawn == len(graph.edges) and graph.edges.groupby(["x1", "y1"]).size().max() <= 2


def test_the_mtp_figure_greys_the_draft_the_rate_leaves_out():
    """The first written token's draft was made in the prefill: the acceptance rate leaves it out, so
    the figure draws it grey, and blue and red bars count what the rate counts."""
    from app.topics import generation

    steps = pd.DataFrame(
        {
            "position": [3, 4, 5, 6],
            "token": ["a", "b", "c", "d"],
            "mtp_draft": ["a", "b", "<b>x</b>", "d"],
            "mtp_draft_prob": [0.5, 0.4, 0.3, 0.2],
            "mtp_accepted": [True, True, False, True],
            "mtp_verified": [False, True, True, True],
        }
    )
    drafts = generation.mtp_drafts(steps, start=3)
    fig = generation.mtp_figure(drafts)
    colours = list(fig.data[0].marker.color)
    assert colours == [COLORS["norm"], COLORS["attention"], COLORS["marker"], COLORS["attention"]]
    assert "grey: drafted in the prefill" in fig.layout.title.text
    # the hover names the draft: a plain %{customdata} (plotly has no !r), escaped as plotly reads HTML
    assert "%{customdata}" in fig.data[0].hovertemplate and list(fig.data[0].customdata)[2] == "&lt;b&gt;x&lt;/b&gt;"


@pytest.mark.parametrize("spread", [40, 1])
def test_the_contribution_graph_writes_its_squares_labels_only_where_they_fit(spread):
    """Squares 40 positions apart leave room for their labels; side by side (a long prompt's graph) the
    labels would run into each other, so the hover holds them and the title says so."""
    xs = [0, spread, 2 * spread]
    rows = [(x, 1, x, 2, 0.5, "ffn") for x in xs] + [(0, 0, 120, 1, 0.5, "attention")]  # 121 positions drawn
    edges = pd.DataFrame(rows, columns=["x0", "y0", "x1", "y1", "share", "kind"])
    nodes = pd.DataFrame([(x, 1.5, "e5 0.31 · shared 0.12", 0.5) for x in xs], columns=["x", "y", "label", "share"])
    labels = [f"{i} t" for i in range(121)]
    fig = attribution.flow_figure(attribution.Graph(edges, nodes, ["embedding", "0 attention", "0 FFN"]), labels, 120)
    (squares,) = kind(fig, "scatter", "FFN (experts)")
    written = squares.mode == "markers+text"
    assert written == (spread == 40)
    assert ("hover a square" in fig.layout.title.text) != written


@pytest.mark.parametrize("name", plots.names())
def test_every_figure_hovers_its_values(trace, name):
    fig = plots.plot(trace, name, block=MOE)
    for shown in fig.data:
        if shown.x is not None and len(shown.x) and all(v is None for v in shown.x):
            continue  # a legend entry, no data
        assert shown.hovertemplate or shown.hoverinfo == "skip", (name, shown.type, shown.name)


# --- the attribution's scales: diverging parts on a symmetric scale, the graph's largest edges -------------
def test_diverging_parts_sit_on_a_symmetric_scale_that_marks_a_dominating_part():
    grid = np.array([[0.1, -0.2, 0.05, 0.3], [-0.15, 9.0, 0.2, -0.25]])
    columns = ["head 0", "head 1", "routed experts", "shared / MLP"]
    fig = attribution.grid_figure(grid, ["block 0", "block 1"], columns)
    heat = fig.data[0]
    assert heat.zmin == -heat.zmax and heat.zmax == pytest.approx(0.3)  # the largest |part| but the outlier's
    assert np.asarray(heat.text)[1, 1] == "▲" and "head 1 beyond the scale (part up to 9" in fig.layout.title.text
    assert heat.colorbar.ticktext[0].startswith("≤") and heat.colorbar.ticktext[-1].startswith("≥")
    plain = symmetric_range(grid[:, [0, 2, 3]])
    assert plain.hi == pytest.approx(0.3) and plain.lo == -plain.hi and not plain.clipped


@pytest.fixture(scope="module")
def flow_trace(tiny_model):
    return run(tiny_model, TraceRequest(token_ids=TOKENS, attribute=True, record=("default", "flow")))


def test_the_contribution_graph_draws_each_streams_largest_edges(flow_trace):
    position = flow_trace.extra["attribution"]["position"]
    few, wide = (attribution.flow_graph(flow_trace, position, top=k) for k in (1, 3))
    assert (few.edges.groupby(["x1", "y1"]).size() == 1).all()  # one edge into each stream it reaches
    into = wide.edges.groupby(["x1", "y1"]).size()
    assert into.max() == 3 and len(few.edges) < len(wide.edges)
    shares = attribution.flow_graph(flow_trace, position, threshold=0.3)
    assert (shares.edges["share"] > 0.3).all()
    fig = attribution.flow_figure(wide, position_labels(flow_trace), position)
    assert "each stream's top 3 edges" in fig.layout.title.text


# --- the app's switches -------------------------------------------------------------------------------------
def test_the_pages_switch_the_first_token_out_of_their_scales(app_checkpoint, monkeypatch):
    from tests.app.apptest import raised_nothing, start

    at = start(monkeypatch, app_checkpoint, "views/residual.py")
    titles = lambda: [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]  # noqa: E731
    assert any("beyond the scale" in t for t in titles())  # the demo's first token dominates the stream
    at.toggle(key="resid_skip_first").set_value(True)
    at = raised_nothing(at.run())
    assert any("position 0 left out" in t for t in titles()) and not any("beyond the scale" in t for t in titles())
    at = raised_nothing(at.switch_page("views/router.py").run())
    at.session_state["router_tab"] = "Routed and shared"
    at = raised_nothing(at.run())
    assert any("routed vs shared" in t and "beyond the scale" in t for t in titles())
    at.toggle(key="router_skip_first").set_value(True)
    at = raised_nothing(at.run())
    assert any("routed vs shared" in t and "position 0 left out" in t for t in titles())


def test_a_notebook_draws_the_contribution_graph_and_a_patching_map(trace, tiny_model):
    """app.plots outside the app: the contribution graph of a trace recorded with flow, and a patching
    sweep's heat map from its table and summary, as the pages draw them."""
    from tracing.analyses.patching import sweep

    graph = plots.plot(trace, "contribution_graph", position=len(TOKENS) - 2, top=2)
    assert f"into position {len(TOKENS) - 2}: each stream's top 2 edges" in graph.layout.title.text
    assert kind(graph, "scatter", "attention") and kind(graph, "scatter", "FFN (experts)")
    with pytest.raises(ValueError, match="position 99"):
        plots.plot(trace, "contribution_graph", position=99)
    clean, corrupt = TOKENS[:6], [*TOKENS[:5], 250]
    requests = TraceRequest(token_ids=clean), TraceRequest(token_ids=corrupt)
    swept = sweep(lambda r: run(tiny_model, r), *requests, sites=["heads"], positions="5:6")
    fig = plots.patching_map(swept.table, "heads", swept.summary)
    (heat,) = fig.data
    assert heat.type == "heatmap" and len(heat.y) == TINY.n_layers and len(heat.x) == len(clean)
    assert "→" in heat.x[-1] and "(head %{customdata})" in heat.hovertemplate
    with pytest.raises(ValueError, match="no row of site 'experts'"):
        plots.patching_map(swept.table, "experts", swept.summary)


def test_a_click_on_the_graph_opens_a_heads_or_an_experts_detail(trace):
    """The graph's diamonds and squares carry their node; the browser's selection of one reads back as it,
    and the node's detail holds each head's part, sources and dropped keys, each expert's share, part and
    lens, as the trace recorded them at the attributed position (NaN elsewhere)."""
    from app.topics import graph_nodes

    position = trace.extra["attribution"]["position"]
    fig = attribution.flow_figure(attribution.flow_graph(trace, position), position_labels(trace), position)
    (diamonds,) = kind(fig, "scatter", "heads (click)")
    (squares,) = kind(fig, "scatter", "FFN (experts)")
    clicks = [{"curve_number": 0, "point_index": 0, "x": "0"}, {"customdata": ["attention", 99, 0]}]  # an edge, a forged node
    assert graph_nodes.picked(clicks, trace) is None
    head_node = next(
        n
        for n in (graph_nodes.picked([{"customdata": list(d)}], trace) for d in diamonds.customdata)
        if n.position == position and n.block == MOE
    )
    heads = graph_nodes.heads(trace, head_node)
    parts = trace.site(MOE, "attn.attribution").double().numpy()
    assert sorted(heads["part"]) == pytest.approx(sorted(parts)) and abs(heads["part"][0]) == pytest.approx(abs(parts).max())
    assert heads["sources"][0] and heads["dropped_keys"].notna().all()
    assert graph_nodes.keys(trace, head_node)["share"].sum() == pytest.approx(1.0, abs=1e-5)
    ffn_node = next(
        n
        for n in (graph_nodes.picked([{"customdata": list(d)}], trace) for d in squares.customdata)
        if n.position == position and n.block == MOE
    )
    experts = graph_nodes.experts(trace, ffn_node)
    routed = experts[experts["expert"] >= 0]
    ffn = trace.site(MOE, "ffn.attribution").double().numpy()
    assert len(routed) and list(routed["part"]) == pytest.approx([ffn[e] for e in routed["expert"]])
    assert routed["promotes"].str.len().gt(0).all()
    elsewhere = graph_nodes.Node("ffn", MOE, position - 1)
    assert graph_nodes.experts(trace, elsewhere)["part"].isna().all() and graph_nodes.heads(trace, elsewhere)["part"].isna().all()
