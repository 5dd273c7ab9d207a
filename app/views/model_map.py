"""Model map: the blocks (dense and MoE), parameter counts per component, the config, the prompt."""

from __future__ import annotations

import streamlit as st

from app.core.session import View
from app.topics import card_plots, cards, model_map
from app.ui import card_view, widgets
from tracing.sites import INDEXER_MISSING


def page() -> None:
    view = widgets.page_view(
        "Model map",
        "DeepSeek-V3.2-Exp block by block: which blocks are dense and which MoE, where the parameters sit, "
        "and what your prompt came out as. Pick a block in the sidebar; the other pages follow it.",
    )
    if view is None:
        return
    cfg = view.config
    counts = model_map.param_counts(cfg)
    row = st.container(horizontal=True, gap="medium")  # one flex row: six columns would be seven more elements
    row.metric("Blocks", cfg.n_layers, help=f"{cfg.n_dense_layers} dense, {cfg.n_moe_layers} MoE")
    row.metric("Width d", f"{cfg.dim:,}")
    row.metric(
        "Heads",
        cfg.n_heads,
        help=f"MLA heads; the indexer has {cfg.index_n_heads}" if cfg.has_indexer else f"MLA heads; {INDEXER_MISSING}",
    )
    row.metric(
        "Experts",
        f"{cfg.n_activated_experts} of {cfg.n_routed_experts}",
        help=f"+ {cfg.n_shared_experts} shared; {cfg.n_expert_groups} groups, {cfg.n_limited_groups} chosen per token",
    )
    row.metric("Parameters", model_map.human(counts["total_params"]), help=f"{counts['total_params']:,} (without the MTP module)")
    row.metric(
        "Activated per token",
        model_map.human(counts["activated_params"]),
        help=f"{counts['activated_params']:,}, without the embedding",
    )

    st.subheader("Blocks", anchor=False)
    widgets.memo_chart(
        view,
        "block_map",
        lambda: model_map.block_map_figure(cfg, model_map.params_by_block(cfg), view.block),
        view.block,
    )
    mla = "MLA (with the lightning indexer)" if cfg.has_indexer else "MLA"
    st.caption(
        f"Every block: attn_norm → {mla} → ffn_norm → FFN. Dense MLP: "
        f"{cards.facts_for(cfg)['dense_blocks']}; mixture of experts: {cards.facts_for(cfg)['moe_blocks']}. "
        "Hover a cell for its parameter count; the outlined column is the chosen block."
    )
    if not cfg.has_indexer:
        widgets.no_indexer()

    widgets.lazy_tabs(
        {
            "Your prompt": lambda: _prompt(view),
            "Parameters per component": lambda: _params(view),
            "Config": lambda: widgets.table(st, model_map.config_table(cfg), "config"),
            "The transformer block": lambda: card_view.card(cards.load_cards()["block"], view, key="map_block"),
        },
        "model_map_tab",
    )


def _prompt(view: View) -> None:
    st.markdown(model_map.token_strip(view.trace.tokens))
    widgets.memo_chart(view, "next_token", lambda: card_plots.next_token(view, view.block))


def _params(view: View) -> None:
    frame = model_map.params_table(view.config)
    left, right = st.columns([3, 2], gap="large")
    with left:
        widgets.memo_chart(view, "params", lambda: model_map.params_figure(frame))
    right.dataframe(
        frame[["component", "total", "activated", "share"]],
        hide_index=True,
        column_config={
            "total": st.column_config.NumberColumn(format="localized"),
            "activated": st.column_config.NumberColumn("activated per token", format="localized"),
            "share": st.column_config.ProgressColumn("share of total", format="percent", min_value=0, max_value=1),
        },
    )
    widgets.keep("table:params", "parameters per component", frame)


if __name__ == "__main__":
    page()
