"""Model map: the blocks (dense and MoE), parameter counts per component, the config, the prompt."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app import card_plots, cards, plots, shaping, state, widgets

CONFIG_GROUPS = {
    "widths": ("vocab_size", "dim", "inter_dim", "moe_inter_dim", "n_layers", "n_dense_layers", "n_heads", "norm_eps"),
    "MLA": ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
    "lightning indexer": ("index_n_heads", "index_head_dim", "index_topk"),
    "MoE router": (
        "n_routed_experts",
        "n_shared_experts",
        "n_activated_experts",
        "n_expert_groups",
        "n_limited_groups",
        "score_func",
        "route_scale",
    ),
    "RoPE / YaRN": ("max_seq_len", "original_seq_len", "rope_theta", "rope_factor", "beta_fast", "beta_slow", "mscale"),
    "storage": ("dtype", "scale_fmt"),
}


def config_table(cfg) -> pd.DataFrame:
    rows = [(group, name, str(getattr(cfg, name))) for group, names in CONFIG_GROUPS.items() for name in names]
    rows.append(("MoE router", "correction bias", "yes" if cfg.has_gate_bias else "no"))
    rows.append(("RoPE / YaRN", "YaRN", "on" if cfg.use_yarn else "off"))
    rows.append(("MLA", "softmax scale", f"{cfg.softmax_scale:.6f}"))
    return pd.DataFrame(rows, columns=["section", "field", "value"])


def page() -> None:
    view = state.current()
    widgets.page_header(
        "Model map",
        "DeepSeek-V3.2-Exp block by block: which blocks are dense and which MoE, where the parameters sit, "
        "and what your prompt came out as. Pick a block in the sidebar; the other pages follow it.",
        view,
    )
    if view is None:
        widgets.no_trace()
        return
    cfg = view.config
    counts = shaping.param_counts(cfg)
    cols = st.columns(6)
    cols[0].metric("Blocks", cfg.n_layers, help=f"{cfg.n_dense_layers} dense, {cfg.n_moe_layers} MoE")
    cols[1].metric("Width d", f"{cfg.dim:,}")
    cols[2].metric("Heads", cfg.n_heads, help=f"MLA heads; the indexer has {cfg.index_n_heads}")
    cols[3].metric(
        "Experts",
        f"{cfg.n_activated_experts} of {cfg.n_routed_experts}",
        help=f"+ {cfg.n_shared_experts} shared; {cfg.n_expert_groups} groups, {cfg.n_limited_groups} chosen per token",
    )
    cols[4].metric("Parameters", _human(counts["total_params"]), help=f"{counts['total_params']:,} (without the MTP module)")
    cols[5].metric(
        "Activated per token", _human(counts["activated_params"]), help=f"{counts['activated_params']:,}, without the embedding"
    )

    st.subheader("Blocks", anchor=False)
    widgets.memo_chart(view, "block_map", lambda: plots.block_map(cfg, shaping.params_by_block(cfg), view.block), view.block)
    st.caption(
        f"Every block: attn_norm → MLA (with the lightning indexer) → ffn_norm → FFN. Dense MLP: "
        f"{cards.facts_for(cfg)['dense_blocks']}; mixture of experts: {cards.facts_for(cfg)['moe_blocks']}. "
        "Hover a cell for its parameter count; the outlined column is the chosen block."
    )

    left, right = st.columns([3, 2], gap="large")
    with left:
        st.subheader("Parameters per component", anchor=False)
        frame = shaping.params_table(cfg)
        widgets.memo_chart(view, "params", lambda: plots.params_bars(frame))
        st.dataframe(
            frame[["component", "total", "activated", "share"]],
            hide_index=True,
            column_config={
                "total": st.column_config.NumberColumn(format="localized"),
                "activated": st.column_config.NumberColumn("activated per token", format="localized"),
                "share": st.column_config.ProgressColumn("share of total", format="percent", min_value=0, max_value=1),
            },
        )
    with right:
        st.subheader("Your prompt", anchor=False)
        st.markdown(_token_strip(view))
        widgets.memo_chart(view, "next_token", lambda: card_plots.next_token(view, view.block))
        with st.expander("Config"):
            st.dataframe(config_table(cfg), hide_index=True, width="stretch")

    st.subheader("The transformer block", anchor=False)
    widgets.card(cards.load_cards()["block"], view, key="map_block")


def _human(n: int) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


def _token_strip(view) -> str:
    """Tokens as badges, position first, whitespace made visible."""
    items = []
    for i, tok in enumerate(view.trace.tokens):
        shown = shaping.show_token(tok, limit=20, html_escape=False).replace("`", "ˋ")
        items.append(f"`{i}`&nbsp;`{shown}`")
    return " ".join(items)


if __name__ == "__main__":
    page()
