"""Residual stream: norms per layer and position, cosine between consecutive layers, update sizes,
and the logit lens."""

from __future__ import annotations

import streamlit as st

from app import card_plots, plots, shaping, state, widgets


def page() -> None:
    view = state.current()
    widgets.page_header(
        "Residual stream",
        "The stream x every block reads and writes: how large it is, how much each block turns it, how big "
        "the attention and FFN updates are, and what the output head would already predict from it.",
        view,
    )
    if view is None:
        widgets.no_trace()
        return
    widgets.compact_cards(["rmsnorm", "block", "head"], view, key="residual")
    labels = card_plots.labels(view)
    grids = view.memo("residual_grids", lambda: shaping.residual_grids(view.table("residual"), view.n_tokens))
    if grids is None:
        widgets.missing("No residual stream", ["layers.{i}.resid_pre", "layers.{i}.resid_mid", "layers.{i}.resid_post"])
    else:
        left, right = st.columns(2, gap="large")
        with left:
            widgets.memo_chart(view, "resid_norm", lambda: plots.residual_norms(grids, labels))
        with right:
            widgets.memo_chart(view, "resid_cos", lambda: plots.residual_cosine(grids, labels))
        left, right = st.columns(2, gap="large")
        with left:
            widgets.memo_chart(view, "resid_updates", lambda: plots.update_sizes(grids))
        with right:
            widgets.memo_chart(view, "resid_block_updates", lambda: card_plots.block_updates(view, view.block), view.block)
    st.subheader("Logit lens", anchor=False)
    st.caption(
        "The final RMSNorm and the output head applied to each block's output $x_{n+1}$: the colour is the "
        "probability of the top token (written in the cell); hover for the top 5. The last row is the model's "
        "own prediction."
    )
    lens = view.memo("lens", lambda: shaping.logit_lens(view.trace))
    if lens is None:
        widgets.missing("No logit lens", ["layers.{i}.logit_lens.topk_indices"])
    else:
        widgets.memo_chart(view, "logit_lens", lambda: plots.logit_lens(lens, labels))


if __name__ == "__main__":
    page()
