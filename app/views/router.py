"""Router and experts: scores over tokens x experts with group boundaries, the chosen groups, the
selected experts and their weights, what the correction bias changed, and expert load per block."""

from __future__ import annotations

import streamlit as st

from app import card_plots, plots, shaping, state, widgets


def page() -> None:
    view = state.current()
    widgets.page_header(
        "Router & experts",
        "How each token is sent to a few of the routed experts: sigmoid scores, group-limited selection with the "
        "load-balancing bias, gating weights, and where tokens went across the MoE blocks.",
        view,
    )
    if view is None:
        widgets.no_trace()
        return
    cfg = view.config
    widgets.compact_cards(["router", "experts", "mlp"], view, key="router")
    block, note = card_plots.applicable_block("moe", view, view.block)
    if block is None:
        st.info(note)
        return
    if note:
        st.info(note, icon=":material/info:")
    r = shaping.routing(view.trace, block)
    if r is None:
        widgets.missing("No routing", ["layers.{i}.ffn.gate.topk_indices"], block)
        return
    labels = card_plots.labels(view)
    st.subheader(f"Block {block}: router scores", anchor=False)
    biased = st.toggle(
        "Show the biased scores s + b (what selection ranks)",
        key="router_biased",
        disabled=r.biased is None,
        help="Off: the sigmoid scores s the weights come from. On: s plus the correction bias b.",
    )
    if r.scores is None:
        widgets.missing("No scores", ["layers.{i}.ffn.gate.scores"], block)
    else:
        widgets.memo_chart(
            view, "router_scores", lambda: plots.router_scores(r, labels, cfg.experts_per_group, biased=biased), block, biased
        )
    left, right = st.columns([2, 3], gap="large")
    with left:
        if r.group_scores is not None and r.groups_chosen is not None:
            widgets.memo_chart(view, "router_groups", lambda: plots.groups(r, labels), block)
        else:
            widgets.missing("No group scores", ["layers.{i}.ffn.gate.group_scores", "layers.{i}.ffn.gate.groups"], block)
    with right:
        widgets.memo_chart(view, "router_weights", lambda: card_plots.expert_weights(view, block), block)

    st.subheader("What the correction bias changed", anchor=False)
    effect = view.memo(("bias_effect", block), lambda: shaping.bias_effect(view.trace, block))
    if effect is None:
        widgets.missing("No bias comparison", ["layers.{i}.ffn.gate.scores", "layers.{i}.ffn.gate.biased_scores"], block)
    else:
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
        widgets.memo_chart(view, "router_bias", lambda: plots.bias(effect, cfg.experts_per_group), block)
        changes = shaping.bias_changes(view.trace, effect)
        if not changes.empty:
            with st.expander(f"The {len(changes)} tokens whose experts the bias changed"):
                st.dataframe(changes, hide_index=True, width="stretch")

    if shaping.routed_shared(view.trace, block) is not None:
        widgets.memo_chart(
            view, "router_routed_shared", lambda: plots.routed_shared(shaping.routed_shared(view.trace, block), block), block
        )

    st.subheader("Expert load across blocks", anchor=False)
    got = shaping.load_grid(view.table("expert_load"))
    if got is None:
        widgets.missing("No expert load", ["layers.{i}.ffn.gate.topk_indices"])
    else:
        widgets.memo_chart(view, "expert_load", lambda: plots.expert_load(got[0], got[1], got[2], view.n_tokens))


if __name__ == "__main__":
    page()
