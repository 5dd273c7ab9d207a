"""Residual stream: norms per block and position, cosine between consecutive blocks, update sizes,
and the logit lens."""

from __future__ import annotations

import streamlit as st

from app.core.session import View
from app.topics import card_plots, predictions, residual, tokens
from app.topics.figures import TICK_LIMIT
from app.ui import card_view, widgets

STREAM_SITES = ["layers.{i}.resid_pre", "layers.{i}.resid_mid", "layers.{i}.resid_post"]


def page() -> None:
    view = card_view.topic_page(
        "Residual stream",
        "The stream x every block reads and writes: how large it is, how much each block turns it, how big "
        "the attention and FFN updates are, and what the output head would already predict from it.",
        ["rmsnorm", "block", "head"],
        "residual",
    )
    if view is None:
        return
    grids = view.memo("residual_grids", lambda: residual.residual_grids(view.table("residual"), view.n_tokens))
    labels = tokens.labels(view)

    def stream(key: str, build, *options) -> None:
        if grids is None:
            widgets.missing("No residual stream", STREAM_SITES)
        else:
            widgets.memo_chart(view, key, lambda: build(grids, labels, *options), *options)

    def norms() -> None:
        skip = widgets.first_token_toggle("resid_skip_first")
        stream("resid_norm", residual.residual_norms_figure, skip)

    widgets.lazy_tabs(
        {
            "Stream norm": norms,
            "Turn per block": lambda: stream("resid_cos", residual.residual_cosine_figure),
            "Update sizes": lambda: _updates(view, grids),
            "Logit lens": lambda: _logit_lens(view, labels),
        },
        "residual_tab",
    )


def _updates(view: View, grids: residual.ResidualGrids | None) -> None:
    left, right = st.columns(2, gap="large")
    with left:
        if grids is None:
            widgets.missing("No update sizes", STREAM_SITES)
        else:
            widgets.memo_chart(view, "resid_updates", lambda: residual.update_sizes_figure(grids))
    with right:
        skip = widgets.first_token_toggle("resid_updates_skip_first")
        build = lambda: card_plots.block_updates(view, view.block, skip_first=skip)  # noqa: E731
        fig = widgets.memo_chart(view, "resid_block_updates", build, view.block, skip)
        if fig is None:
            widgets.missing("No update sizes", STREAM_SITES, view.block)


def _logit_lens(view: View, labels: list[str]) -> None:
    st.caption(
        "The final RMSNorm and the output head applied to each block's output $x_{n+1}$: the colour is the "
        f"probability of the top token (written in the cell up to {TICK_LIMIT} positions; the title says which); hover "
        "for the top 5. The last row is the model's own prediction."
    )
    lens = view.memo("lens", lambda: predictions.logit_lens(view.trace))
    if lens is None:
        widgets.missing("No logit lens", ["layers.{i}.logit_lens.topk_indices"])
    else:
        widgets.memo_chart(view, "logit_lens", lambda: predictions.logit_lens_figure(lens, labels))


if __name__ == "__main__":
    page()
