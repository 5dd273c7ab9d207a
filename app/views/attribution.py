"""Attribution: why the model predicts what it does. One logit (the target at a position, or target
minus a contrast) split over the embedding, every block's heads and routed experts and the rest;
one block's parts with each expert's logit lens; the prompt's tokens coloured by what they brought
through the attention; and, on request, the contribution graph of positions x blocks.

The session keeps only the pickers' values; the attributed traces live in the process-wide store
(app.core.traces), one per position, target, contrast and graph, beside the plain trace."""

from __future__ import annotations

import html

import streamlit as st

from app.core.errors import BAD_INPUT
from app.core.models import AppModel
from app.core.session import View, session_model
from app.core.traces import Entry, TraceKey
from app.topics import attribution as topic
from app.topics import attribution_runs as runs
from app.topics import graph_nodes as nodes
from app.topics.attribution_runs import NONE
from app.topics.tokens import labels
from app.ui import card_view, causal, graph_node, widgets
from tracing.analyses.attribution import AttributionRequest

FLOW_FOR = "attr_flow_for"  # the plain trace's key for which the graph was asked (the button)
TARGET_HELP = "The position's ten most likely next tokens, the most likely first."
CONTRAST_HELP = "Attribute the target's logit minus this token's: what makes the model prefer one over the other."
ANY_HELP = "Any token of the vocabulary, by its text (a leading space is part of it: ' Wentworth') or its id."


NEEDS = (
    "The attribution runs the model again: choose **Bundled demo** or a **Checkpoint directory** in the sidebar. "
    "A trace file shows its attribution when it was made with one: "
    "`python -m tracing run ... --attribute [--position P] [--target TOKEN] [--record default,flow]`."
)
INTRO = (
    "Which blocks, heads, experts and earlier tokens made a prediction: with the final norm's scale frozen, the logit "
    "is a sum of one number per part (docs/attribution.md). Keys the indexer dropped bring nothing."
)


def page() -> None:
    view = card_view.topic_page("Attribution", INTRO, ["head", "mla", "experts"], "attribution")
    if view is None:
        return
    if topic.attributed(view.trace) is not None:  # a trace file made with --attribute: shown as it is
        st.caption(":material/info: This trace holds an attribution: shown as it was recorded.")
        show(View(view.entry, view.block))
        return
    key = view.entry.key
    om = widgets.page_model(NEEDS, NEEDS, shown=key)  # a trace file: the same words
    if om is None:
        return
    request = pickers(view.entry, key.plain)
    flow = st.session_state.get(FLOW_FOR) == key.plain
    entry = attributed(om, key.plain, request, flow)
    if entry is not None:
        show(View(entry, view.block))
        causal.causal_view(om, key.plain, View(entry, view.block))


def pickers(base: Entry, plain: TraceKey) -> AttributionRequest:
    """Position (default: the last), target (default: the top prediction there) and an optional contrast."""
    trace = base.trace
    n = trace.n_tokens
    runs.fit_pickers(st.session_state, plain, n)
    names = labels(base)
    left, middle, right = st.columns(3)
    position = left.selectbox("Position", range(n), key="attr_position", format_func=lambda t: names[t])
    options = topic.candidates(trace, position)
    if not options:  # a trace without next.topk_*: the top prediction, whichever it is
        return AttributionRequest(position)
    target = widgets.pick(middle, "Target", options, "attr_target", lambda i: topic.token_name(trace, i), TARGET_HELP)
    others = [NONE, *(i for i in options if i != target)]
    name = lambda i: "none" if i == NONE else f"minus {topic.token_name(trace, i)}"  # noqa: E731
    contrast = widgets.pick(right, "Contrast", others, "attr_contrast", name, CONTRAST_HELP)
    typed = middle.text_input("…or any token", key="attr_target_text", placeholder="text or id", help=ANY_HELP)
    typed_contrast = right.text_input("…or any token", key="attr_contrast_text", placeholder="text or id", help=ANY_HELP)
    try:
        return runs.request_of(session_model(), position, target, contrast, typed, typed_contrast)
    except BAD_INPUT as exc:
        st.error(f"**Not attributed.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        st.stop()


def attributed(om: AppModel, plain: TraceKey, request: AttributionRequest, flow: bool) -> Entry | None:
    try:
        with st.spinner("Attributing…"):
            return runs.attributed(om, plain, request, flow)
    except BAD_INPUT as exc:
        st.error(f"**Not attributed.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


def show(view: View) -> None:
    trace = view.trace
    info = topic.attributed(trace)
    position = info["position"]
    what = topic.what(trace)
    coarse = view.memo("attr_coarse", lambda: topic.coarse_parts(trace))
    rest = f"{info['rest']:+.5f}, {topic.rest_share(coarse, info['rest']):.3%} of the parts' total size"
    st.markdown(f"At position **{position}**, {widgets.escape_md(what)} is **{info['total']:+.4f}**; the rest is {rest}.")
    grid = view.memo("attr_grid", lambda: topic.block_grid(trace))
    widgets.side_by_side(
        view,
        ("attr_waterfall", lambda: topic.waterfall_figure(coarse, info["total"], html.escape(what))),
        ("attr_grid", lambda: topic.grid_figure(*grid)),
    )
    dropped_view(view)
    block_view(View(view.entry, chosen_block(view)))
    prompt_view(view, position)
    graph_view(view, position)
    with st.expander("Every part as a table (sources: each head's split over the keys it read)"):
        table = view.table("attribution")
        widgets.table(st, table, "attribution")
        widgets.csv_button(st, table, "attribution.csv", "attr_csv")


def dropped_view(view: View) -> None:
    """The sparsity's cost to this logit: per block, what attending over every causal key instead of
    the indexer's selection would have added (0 where it kept every key)."""
    frame = view.memo("attr_dropped", lambda: topic.dropped_by_block(view.trace))
    if frame is None:
        return
    total = float(frame["dropped"].sum())
    st.caption(
        f"The keys the indexer dropped would have added **{total:+.4f}** in all: each block's heads again over every "
        "causal key from the same scores and values, less what they did (docs/attribution.md)."
    )
    widgets.memo_chart(view, "attr_dropped_chart", lambda: topic.dropped_figure(frame))


def chosen_block(view: View) -> int:
    """The block whose parts are shown: it opens on the block of the largest head or expert part
    (where the answer is), for each attributed trace; then the reader's choice."""
    runs.fit_block(st.session_state, view.entry, view.block)
    return st.selectbox(
        "Block",
        range(view.config.n_layers),
        key="attr_block",
        format_func=lambda b: f"block {b}",
        help="Opens on the block of the largest head or expert part.",
    )


def block_view(view: View) -> None:
    block = view.block
    st.subheader(f"Block {block}", anchor=False)
    parts = view.memo(("attr_block", block), lambda: topic.block_parts(view.trace, block))
    if parts is None:
        widgets.missing("No parts", ["layers.{i}.attn.attribution"], block)
        return
    widgets.side_by_side(
        view,
        ("attr_heads", lambda: topic.heads_figure(parts, block), block),
        ("attr_ffn", lambda: topic.ffn_figure(parts, block), block),
    )
    causal.removals(view, block)
    lens = parts.ffn[parts.ffn["promotes"] != ""]
    if not lens.empty:
        st.caption("Each chosen expert's weighted output through the frozen final norm and the head (the logit lens):")
        widgets.table(st, lens.drop(columns="expert"), f"block {block} expert lens")


def prompt_view(view: View, position: int) -> None:
    st.subheader("What each token brought through the attention", anchor=False)
    totals = view.memo("attr_sources", lambda: topic.source_totals(view.trace))
    if totals is None:
        widgets.missing("No sources", ["layers.{i}.attn.attribution_src"])
        return
    st.caption(
        "Each earlier token's part of the logit, summed over every head of every block: green raised it, red lowered it "
        "(hover a token for its value). The position is outlined."
    )
    st.html(topic.coloured_prompt(view.trace, totals, position))


def graph_view(view: View, position: int) -> None:
    st.subheader("Contribution graph", anchor=False)
    trace = view.trace
    if not trace.layers_with("attn.flow"):
        st.caption(
            "How much each position's stream fed each later one through the attention, and each expert added, "
            "as shares of the receiving stream (command line: `--record default,flow`)."
        )
        key = st.session_state.get("trace_key")
        plain = key.plain if key is not None and key.traced else None
        st.button(
            "Compute the contribution graph",
            key="attr_flow_run",
            icon=":material/hub:",
            disabled=plain is None,
            on_click=lambda: st.session_state.__setitem__(FLOW_FOR, plain),
        )
        return
    st.session_state.setdefault("attr_threshold", 0.05)
    st.session_state.setdefault("attr_top", topic.TOP_EDGES)
    st.session_state.setdefault("attr_edges", "top k per stream")
    rule, amount = st.columns([1, 3], vertical_alignment="bottom")
    by_share = rule.segmented_control("Edges", ["top k per stream", "above a share"], key="attr_edges") == "above a share"
    if by_share:
        top, cut = topic.TOP_EDGES, amount.slider("Threshold", 0.01, 0.5, key="attr_threshold", step=0.01)
    else:
        top, cut = int(amount.number_input("k", 1, 20, key="attr_top", help="Each stream's k largest inputs.")), None
    words = topic.edge_rule(top, cut)
    graph = view.memo(("attr_graph", position, cut, top), lambda: topic.flow_graph(trace, position, cut, top))
    fig = view.memo(("figure", "attr_flow", position, cut, top), lambda: topic.flow_figure(graph, labels(view), position, words))
    event = widgets.chart(fig, key="attr_flow", select=True)  # a click on a diamond or a square opens its detail
    graph_node.node_view(view, nodes.picked(event.selection.points, trace) if event is not None else None)


if __name__ == "__main__":
    page()
