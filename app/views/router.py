"""Router and experts: scores over tokens x experts with group boundaries, the chosen groups, the
selected experts and their weights, what the correction bias changed, and expert load per block."""

from __future__ import annotations

import streamlit as st

from app.core.session import View
from app.topics import atlas as atlas_topic
from app.topics import card_plots, experts, router, tokens
from app.ui import card_view, widgets
from app.views import atlas as atlas_page
from tracing.tables.frames import NEAR_TIE


def page() -> None:
    view = card_view.topic_page(
        "Router & experts",
        "How each token is sent to a few of the routed experts: sigmoid scores, group-limited selection with the "
        "load-balancing bias, gating weights, and where tokens went across the MoE blocks.",
        ["router", "experts", "mlp"],
        "router",
    )
    if view is None:
        return
    block, note = card_plots.applicable_block("moe", view.config, view.block)
    if block is None:
        st.info(note)
        return
    if note:
        st.info(note, icon=":material/info:")
    r = router.routing(view.trace, block)
    if r is None:
        widgets.missing("No routing", ["layers.{i}.ffn.gate.topk_indices"], block)
        return
    widgets.lazy_tabs(
        {
            "Scores": lambda: _scores(view, r),
            "Groups and weights": lambda: _groups_and_weights(view, r),
            "Correction bias": lambda: _bias(view, block),
            "Routed and shared": lambda: _routed_shared(view, block),
            "Load across blocks": lambda: _load(view),
            "Margins": lambda: _margins(view, block),
            "Atlas expert": lambda: _atlas_expert(view, r),
        },
        "router_tab",
    )


def _atlas_expert(view: View, r: router.Routing) -> None:
    found = atlas_page.session_atlas()
    if found is None or not atlas_topic.matches(found, view.config.to_reference()) or r.block not in atlas_topic.blocks(found):
        st.info(
            "No atlas of this model is open: build one with `python -m tracing atlas --checkpoint DIR --text-file F "
            "--out atlas/` and open it on the Atlas page.",
            icon=":material/public:",
        )
        return
    load = r.selected.sum(axis=0)  # (E,): this prompt's tokens per expert
    expert = st.selectbox(
        "Expert",
        range(len(load)),
        index=int(load.argmax()),  # the busiest expert (ties: the lower number)
        key=f"router_atlas_expert_{r.block}",
        format_func=lambda e: f"expert {e} ({load[e]} of {view.n_tokens} tokens here)",
    )
    marked = r.selected[:, expert]  # (T,)
    st.caption(
        f"Where expert {expert} of block {r.block} fires in this prompt: the {int(marked.sum())} tokens routed to it "
        "are marked (hover: the gate weight); beside, what the atlas counted for it over its corpus."
    )
    left, right = st.columns([3, 2], gap="large")
    left.html(router.marked_tokens(list(view.trace.tokens), marked, r.weight[:, expert]))
    card = atlas_topic.expert_card(found, r.block, expert, atlas_topic.pair_matrix(found, r.block))
    right.markdown(
        f"**In the atlas** ({widgets.escape_md(str(found.summary.get('checkpoint', '?')))}, "
        f"{found.summary.get('tokens', 0):,} tokens): chosen for {card['count']:,} tokens, {card['share'] * 100:.2f}% "
        f"of the block's selections, mean gate weight {card['mean_weight']:.3f}. Its most specific tokens:"
    )
    widgets.table(right, card["tokens"].head(10), f"atlas-expert-{expert}-tokens")


def _margins(view: View, block: int) -> None:
    st.caption(
        "The biased score of the k-th chosen expert minus the best expert not chosen inside the chosen groups "
        "(`ffn.gate.margin`): how near the router came to another choice; the diamonds, the weakest chosen group's "
        "score minus the best unchosen group's (`ffn.gate.group_margin`). Near-ties, below "
        f"{NEAR_TIE:g}, are where a rounding of the scores or the correction bias decides."
    )
    frame = router.margins(view.table("margins"), block)
    if frame is None:
        widgets.missing("No margins", ["layers.{i}.ffn.gate.margin"], block)
        return
    build = lambda: router.margins_figure(frame, tokens.labels(view), block, NEAR_TIE)  # noqa: E731
    widgets.memo_chart(view, "router_margins", build, block)


def _scores(view: View, r: router.Routing) -> None:
    st.subheader(f"Block {r.block}: router scores", anchor=False)
    biased = st.toggle(
        "Show the biased scores s + b (what selection ranks)",
        key="router_biased",
        disabled=r.biased is None,
        help="Off: the sigmoid scores s the weights come from. On: s plus the correction bias b.",
    )
    if r.scores is None:
        widgets.missing("No scores", ["layers.{i}.ffn.gate.scores"], r.block)
        return
    labels, per_group = tokens.labels(view), view.config.experts_per_group
    build = lambda: router.router_scores_figure(r, labels, per_group, biased=biased)  # noqa: E731
    widgets.memo_chart(view, "router_scores", build, r.block, biased)


def _groups_and_weights(view: View, r: router.Routing) -> None:
    left, right = st.columns([2, 3], gap="large")
    with left:
        if r.group_scores is not None and r.groups_chosen is not None:
            widgets.memo_chart(view, "router_groups", lambda: router.groups_figure(r, tokens.labels(view)), r.block)
        else:
            widgets.missing("No group scores", ["layers.{i}.ffn.gate.group_scores", "layers.{i}.ffn.gate.groups"], r.block)
    with right:
        widgets.memo_chart(view, "router_weights", lambda: card_plots.expert_weights(view, r.block), r.block)


def _bias(view: View, block: int) -> None:
    effect = view.memo(("bias_effect", block), lambda: router.bias_effect(view.trace, block))
    if effect is None:
        widgets.missing("No bias comparison", ["layers.{i}.ffn.gate.scores", "layers.{i}.ffn.gate.biased_scores"], block)
        return
    n_slots = effect.with_bias.size
    changed = int(effect.changed.sum())
    cols = st.columns(3)
    cols[0].metric(
        "Expert choices changed by b",
        f"{changed} of {n_slots}",
        help="chosen experts that the same rule with b = 0 would not choose",
    )
    cols[1].metric("Tokens affected", f"{int((effect.changed > 0).sum())} of {view.n_tokens}")
    cols[2].metric(
        "Selection recomputed from s + b",
        "matches the trace" if effect.reproduced else "differs",
        help="The group-limited top-k recomputed here from the recorded biased scores, "
        "compared with the experts the model chose.",
    )
    st.caption(
        "Without the bias, the same rule (groups by the sum of their top-2 scores, then top-k inside the chosen "
        "groups) ranks the unbiased scores s. The bias only moves the choice; the weights always come from s."
    )
    widgets.memo_chart(view, "router_bias", lambda: router.bias_figure(effect, view.config.experts_per_group), block)
    changes = router.bias_changes(view.trace, effect)
    if not changes.empty:
        box = widgets.lazy_expander(f"The {len(changes)} tokens whose experts the bias changed", "router_bias_changes")
        if box is not None:
            widgets.table(box, changes, f"block {block} bias changes")


def _routed_shared(view: View, block: int) -> None:
    outputs = experts.routed_shared(view.trace, block)
    if outputs is None:
        widgets.missing("No expert outputs", ["layers.{i}.ffn.routed_out", "layers.{i}.ffn.shared_out"], block)
    else:
        skip = widgets.first_token_toggle("router_skip_first")
        build = lambda: experts.routed_shared_figure(outputs, block, skip)  # noqa: E731
        widgets.memo_chart(view, "router_routed_shared", build, block, skip)


def _load(view: View) -> None:
    got = experts.load_grid(view.table("expert_load"))
    if got is None:
        widgets.missing("No expert load", ["layers.{i}.ffn.gate.topk_indices"])
    else:
        widgets.memo_chart(view, "expert_load", lambda: experts.expert_load_figure(got[0], got[1], got[2], view.n_tokens))


if __name__ == "__main__":
    page()
