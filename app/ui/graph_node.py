"""The detail of the contribution graph's node the reader clicked (app.topics.graph_nodes): a block's heads
into a position, each with its part of the attributed logit, its sources and what its dropped keys would
have added, and the one-click removal of the chosen head; or a block's FFN at a position, each expert with
its share, its part and its logit lens, and the chosen expert's atlas card."""

from __future__ import annotations

import streamlit as st

from app.core.session import View
from app.topics import atlas as atlas_topic
from app.topics import graph_nodes as nodes
from app.topics import interventions
from app.topics.graph_nodes import Node

from . import widgets
from .causal import INTERVENTIONS

NODE = "attr_node"


def node_view(view: View, picked: Node | None) -> None:
    """Keep the node a click picked; show the last one picked (a click elsewhere keeps it)."""
    if picked is not None and picked != st.session_state.get(NODE):
        st.session_state[NODE] = picked
        st.session_state.pop("attr_node_pick", None)  # the new node's own strongest head or expert first
    node = st.session_state.get(NODE)
    if node is None or node.block >= view.config.n_layers or node.position >= view.n_tokens:
        st.caption("Click a diamond (a block's heads into a position) or a square (its experts) for its detail.")
        return
    st.markdown(f"**{node.title()}**")
    here = nodes.at_attributed(view.trace, node)
    if not here:
        st.caption(
            "Each part of the logit, a head's sources and an expert's lens are computed at the attributed position: "
            "attribute at this one to see them."
        )
        st.button(
            f"Attribute at position {node.position}",
            key="attr_node_at",
            icon=":material/my_location:",
            on_click=lambda: st.session_state.__setitem__("attr_position", node.position),
        )
    if node.kind == "attention":
        _heads(view, node, here)
    else:
        _experts(view, node, here)


def _heads(view: View, node: Node, here: bool) -> None:
    frame = view.memo(("attr_node_heads", node), lambda: nodes.heads(view.trace, node))
    left, right = st.columns([3, 2], gap="large")
    with left:
        st.caption("Each head: its part of the logit (largest |part| first), its largest sources, what its dropped keys add")
        widgets.table(st, frame, f"block {node.block} heads into {node.position}")
    with right:
        st.caption("What the block's attention brought into the position, all heads together (the graph's shares)")
        widgets.table(st, view.memo(("attr_node_keys", node), lambda: nodes.keys(view.trace, node)), "node keys")
    if not here:
        return
    head = st.selectbox("Head", frame["head"].tolist(), key="attr_node_pick", format_func=lambda h: f"head {node.block}:{h}")
    row = frame[frame["head"] == head].iloc[0]
    read = widgets.escape_md(row["sources"] or "nothing")
    st.markdown(
        f"Head {node.block}:{head} wrote **{row['part']:+.4f}** of the logit at position {node.position}; its keys the "
        f"indexer dropped would have added {row['dropped_keys']:+.4f}. It read most from: {read}."
    )
    if st.button(
        f"Ablate head {node.block}:{head} at position {node.position} on the Interventions page",
        key=f"attr_remove_node_{node.block}_{head}",
        icon=INTERVENTIONS.icon,
    ):
        interventions.ask_to_remove(st.session_state, "ablate_heads", node.block, int(head), node.position)
        st.switch_page(str(INTERVENTIONS.file))


def _experts(view: View, node: Node, here: bool) -> None:
    frame = view.memo(("attr_node_experts", node), lambda: nodes.experts(view.trace, node))
    st.caption(
        "Each expert that wrote into the position: its share of the stream after the FFN (the graph's), its part of "
        "the logit and the tokens its weighted output promotes and suppresses (at the attributed position)"
    )
    widgets.table(st, frame.drop(columns="expert"), f"block {node.block} experts at {node.position}")
    routed = [int(e) for e in frame["expert"] if e >= 0]
    if not routed:
        return
    expert = st.selectbox("Expert", routed, key="attr_node_pick", format_func=lambda e: f"expert {node.block}:{e}")
    row = frame[frame["expert"] == expert].iloc[0]
    lens = (
        f" It promotes {widgets.escape_md(row['promotes'])}; it suppresses {widgets.escape_md(row['suppresses'])}."
        if row["promotes"]
        else ""
    )
    part = f" and wrote **{row['part']:+.4f}** of the logit" if here else ""
    st.markdown(f"Expert {node.block}:{expert} brought {row['share']:.1%} of the stream at position {node.position}{part}.{lens}")
    _atlas_card(view, node.block, expert)


def _atlas_card(view: View, block: int, expert: int) -> None:
    from app.views import atlas as atlas_page  # the page's own atlas (its session's, or the bundled one)

    found = atlas_page.session_atlas()
    if found is None or not atlas_topic.matches(found, view.config.to_reference()) or block not in atlas_topic.blocks(found):
        st.caption("No atlas of this model is open: its expert card would show what the expert takes over a corpus.")
        return
    card = atlas_topic.expert_card(found, block, expert, atlas_topic.pair_matrix(found, block))
    st.markdown(
        f"**Atlas card** ({widgets.escape_md(str(found.summary.get('checkpoint', '?')))}, {found.summary.get('tokens', 0):,} "
        f"tokens): chosen for {card['count']:,} tokens, {card['share'] * 100:.2f}% of the block's selections, mean gate "
        f"weight {card['mean_weight']:.3f}. Its most specific tokens:"
    )
    widgets.table(st, card["tokens"].head(10), f"atlas-expert-{block}-{expert}-tokens")
