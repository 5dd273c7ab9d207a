"""The live plot of each card, by the name its JSON gives: shaping, then a figure from app.plots.

A function returns the figure, or None when the trace lacks the sites it needs (an uploaded trace
recorded with a narrow --record); the card then says which sites are missing.
"""

from __future__ import annotations

from collections.abc import Callable

import plotly.graph_objects as go

from . import plots, shaping
from .state import View


def labels(view: View) -> list[str]:
    return view.memo("labels", lambda: shaping.position_labels(view.trace))


def embedded_stream(view: View, block: int, **_) -> go.Figure | None:
    got = shaping.embedded_stream(view.trace)
    return None if got is None else plots.embedded_stream(got[0], got[1], labels(view))


def block_updates(view: View, block: int, **_) -> go.Figure | None:
    df = shaping.block_updates(view.trace, block)
    return None if df is None else plots.block_updates(df, block)


def norm_rms(view: View, block: int, **_) -> go.Figure | None:
    df = shaping.norm_rms(view.trace, block)
    return None if df is None else plots.norm_rms(df, block)


def attention_pattern(view: View, block: int, head: int | None = None, **_) -> go.Figure | None:
    z = shaping.attention_pattern(view.trace, block, head)
    if z is None:
        return None
    which = "mean over heads" if head is None else f"head {head}"
    return plots.attention(z, labels(view), f"Block {block}: attention probabilities ({which})")


def index_scores(view: View, block: int, **_) -> go.Figure | None:
    got = shaping.index_scores(view.trace, block)
    if got is None:
        return None
    scores, chosen = got
    k = min(view.config.index_topk, view.n_tokens)
    # mark whichever is rarer, so the scores stay visible: the selected keys, or (when most
    # visible keys are selected) the ones the sparse attention drops
    dropped = ~shaping.future_mask(len(chosen)) & ~chosen
    if dropped.sum() < chosen.sum():
        title = f"Block {block}: index scores I, keys outside the top {k} crossed (dropped)"
        return plots.index_scores(scores, dropped, labels(view), title, marks="dropped")
    title = f"Block {block}: index scores I, the {k} selected keys per query circled"
    return plots.index_scores(scores, chosen, labels(view), title)


def sparse_mask(view: View, block: int, **_) -> go.Figure | None:
    grid = shaping.mask_categories(view.trace, block)
    if grid is None:
        return None
    return plots.sparse_mask(grid, labels(view), f"Block {block}: the sparse attention mask M")


def mlp_update(view: View, block: int, **_) -> go.Figure | None:
    df = shaping.block_updates(view.trace, block)
    if df is None:
        return None
    return plots.mlp_update(df, block)


def router_scores(view: View, block: int, **_) -> go.Figure | None:
    r = shaping.routing(view.trace, block)
    if r is None or r.scores is None:
        return None
    return plots.router_scores(r, labels(view), view.config.experts_per_group)


def expert_weights(view: View, block: int, **_) -> go.Figure | None:
    df = shaping.expert_weights(view.trace, block)
    return None if df is None else plots.expert_weights(df, labels(view), block, view.config.n_routed_experts)


def next_token(view: View, block: int, **_) -> go.Figure | None:
    df = shaping.next_tokens(view.trace)
    return None if df is None else plots.next_token(df)


PLOTS: dict[str, Callable[..., go.Figure | None]] = {
    "embedded_stream": embedded_stream,
    "block_updates": block_updates,
    "norm_rms": norm_rms,
    "attention_pattern": attention_pattern,
    "index_scores": index_scores,
    "sparse_mask": sparse_mask,
    "mlp_update": mlp_update,
    "router_scores": router_scores,
    "expert_weights": expert_weights,
    "next_token": next_token,
}


def applicable_block(scope: str, view: View, block: int) -> tuple[int | None, str]:
    """The block a card of this scope can show, and a note when it is not the chosen one."""
    cfg = view.config
    if scope == "dense" and cfg.is_moe(block):
        dense = [i for i in range(cfg.n_layers) if not cfg.is_moe(i)]
        if not dense:
            return None, "This model has no dense blocks."
        shown = max(i for i in dense if i <= block) if any(i <= block for i in dense) else dense[0]
        return (
            shown,
            f"Block {block} is an MoE block; the dense MLP runs in blocks {dense[0]}–{dense[-1]}. Showing block {shown}.",
        )
    if scope == "moe" and not cfg.is_moe(block):
        moe = [i for i in range(cfg.n_layers) if cfg.is_moe(i)]
        if not moe:
            return None, "This model has no MoE blocks."
        shown = min(i for i in moe if i >= block) if any(i >= block for i in moe) else moe[0]
        return shown, f"Block {block} is dense (no router); showing the first MoE block after it, block {shown}."
    return block, ""
