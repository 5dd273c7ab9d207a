"""The Interventions page's controls: per MoE block the experts to ablate or zero, per block the heads to
ablate (each also typed as the command line's LAYER:ID,...), the router's bias, the sparse attention,
the positions the removals act at. Their values are the session's; app.topics.intervention_runs reads
them into a spec."""

from __future__ import annotations

import streamlit as st

from app.core.traces import Entry
from app.topics import experts
from app.topics import intervention_runs as runs
from app.topics.interventions import ABLATE, HEADS, ZERO, PerBlock, listing, moe_block_ids

from . import widgets

ATTENTION = ("model", "dense", "topk")


def controls(base: Entry, cfg) -> None:
    blocks = moe_block_ids(cfg)
    with st.container(border=True):
        ablate_col, zero_col, heads_col = st.columns(3, gap="large")
        for column, title, kind, draw in (
            (ablate_col, "Ablate experts", ABLATE, ablation_controls),
            (zero_col, "Zero experts", ZERO, zero_controls),
            (heads_col, "Ablate heads", HEADS, head_controls),
        ):
            with column:
                st.markdown(f"**{title}**")
                if kind.blocks(cfg):
                    draw(base, cfg)
                    typed(kind, cfg)
                else:
                    st.caption("This model has no MoE blocks.")
        router_col, attention_col, clear_col = st.columns(3, gap="large")
        with router_col:
            st.markdown("**Router**")
            st.toggle(
                "Route without the correction bias",
                key="iv_no_bias",
                disabled=not blocks or not cfg.has_gate_bias,
                help="Choose experts by the unbiased scores s, groups by their best expert, as the reference router "
                "without a bias. The weights come from s either way.",
            )
            st.multiselect(
                "In blocks",
                blocks,
                key="iv_no_bias_blocks",
                format_func=lambda b: f"block {b}",
                placeholder="every MoE block",
                disabled=not st.session_state.get("iv_no_bias") or not cfg.has_gate_bias,
            )
            if blocks and not cfg.has_gate_bias:
                st.caption("This checkpoint's router has no correction bias: there is nothing to remove.")
        with attention_col:
            st.markdown("**Sparse attention**")
            st.radio(
                "Keys each query may attend to",
                ATTENTION,
                key="iv_attention",
                disabled=not cfg.has_indexer,
                format_func=lambda m: {
                    "model": f"as the model: the indexer's top {cfg.index_topk}",
                    "dense": "dense: every visible key",
                    "topk": "another index_topk",
                }[m],
            )
            st.number_input(
                "index_topk",
                min_value=1,
                max_value=cfg.max_seq_len,
                step=1,
                key="iv_topk",
                disabled=st.session_state.get("iv_attention") != "topk" or not cfg.has_indexer,
                help=f"The model's is {cfg.index_topk}; with {base.trace.n_tokens} tokens, {base.trace.n_tokens} or "
                "more is dense attention.",
            )
            if not cfg.has_indexer:
                widgets.no_indexer()
            st.toggle(
                "No FP8 activation rounding",
                key="iv_no_act_fp8",
                disabled=cfg.dtype != "fp8" or not cfg.has_indexer,
                help="Every FP8 product takes its input unrounded (the weights stay FP8, dequantised to the activation "
                "dtype), the indexer scores bfloat16 q and k, the MLA latent skips its FP8 simulation: which routing and "
                "key selections the reference's activation rounding decides.",
            )
        with clear_col:
            st.markdown("**Where**")
            st.text_input(
                "Remove experts and heads at positions",
                key="iv_at",
                placeholder=f"every position (or P, A:B of 0..{base.trace.n_tokens - 1})",
                help="P: that position only; A:B: positions A..B-1; A: from A on. Earlier positions stay bit-identical "
                "to the baseline. An attribution's causal check removes a part at the attributed position only. "
                "The command line's LAYER:ID@P.",
            )
            st.button("Clear all", key="iv_clear", on_click=runs.clear, args=(st.session_state,), icon=":material/restart_alt:")


def block_picker(kind: PerBlock, cfg, label: str) -> int:
    return st.selectbox(label, kind.blocks(cfg), key=kind.block_key, format_func=lambda b: f"block {b}")


def expert_picker(base: Entry, cfg, kind: PerBlock, label: str, help: str) -> None:
    """A MoE block, its experts (each with the tokens routed to it in the baseline), and the busiest one to add."""
    block = block_picker(kind, cfg, "MoE block")
    key = f"{kind.prefix}{block}"
    counts = base.memo(("expert_tokens", block), lambda: experts.expert_tokens(base.trace, block))
    st.multiselect(
        label.format(block=block),
        kind.ids(cfg),
        key=key,
        format_func=(lambda e: f"{e} · {counts[e]} tok") if counts is not None else str,
        placeholder="none",
        help=help,
    )
    busiest = experts.busiest_experts(base.trace, block, 5)
    if not busiest:
        return
    st.caption(
        f"Busiest in block {block} (baseline, tokens of {base.trace.n_tokens}): " + " · ".join(f"{e} ({n})" for e, n in busiest)
    )
    left = [e for e, _ in busiest if e not in (st.session_state.get(key) or [])]
    if left:
        st.button(
            f"Add expert {left[0]}, the busiest not picked",
            key=f"iv_add_busiest_{kind.spec_key}",
            on_click=runs.add_expert,
            args=(st.session_state, key, left[0]),
            icon=":material/add:",
        )


def ablation_controls(base: Entry, cfg) -> None:
    expert_picker(
        base,
        cfg,
        ABLATE,
        "Experts never chosen in block {block}",
        "Masked out of the router's scores before the group and expert top-k: each token goes to its next choices "
        f"(the routing changes). At least k = {cfg.n_activated_experts} experts must remain.",
    )


def zero_controls(base: Entry, cfg) -> None:
    expert_picker(
        base,
        cfg,
        ZERO,
        "Experts writing nothing in block {block}",
        "Still chosen, with the same gate weights, but their weighted output is zeroed before the routed sum: the "
        "routing stays as it was and only what these experts write is removed. Unlike Ablate experts, which routes "
        "each token to its next choice. The causal check of an expert's attribution.",
    )


def head_controls(base: Entry, cfg) -> None:
    block = block_picker(HEADS, cfg, "Block")
    st.multiselect(
        f"Heads of block {block} whose output is zero",
        HEADS.ids(cfg),
        key=f"{HEADS.prefix}{block}",
        format_func=lambda h: f"{block}:{h}",
        placeholder="none",
        help="The head's attention probabilities are zeroed, so it reads no value and its output before wo is zero; "
        "the block's other heads and its indexer's keys stay as they were, while its FFN (routing included) and the "
        "later blocks read the changed stream. The causal check of a head's attribution. Shown as LAYER:HEAD, like "
        "--ablate-heads.",
    )


def typed(kind: PerBlock, cfg) -> None:
    """The command line's LAYER:ID,... text, added to the picks, and every block's picks as that flag writes them."""
    st.text_input(
        f"More, typed as LAYER:{kind.what},…",
        key=kind.text_key,
        placeholder="e.g. 1:3,2:0",
        help=f"The command line's {kind.flag} syntax; added to the picks above.",
    )
    picked = {b: st.session_state.get(f"{kind.prefix}{b}") for b in kind.blocks(cfg)}
    shown = listing({b: sorted(ids) for b, ids in picked.items() if ids})
    if shown:
        st.caption(f"Picked: `{kind.flag} {shown}`")
