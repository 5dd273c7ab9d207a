"""The live plot of each card, by the name its JSON gives: a topic's shaping, then its figure.

A function returns the figure, or None when the trace lacks the sites it needs (an uploaded trace
recorded with a narrow --record); the card then says which sites are missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import plotly.graph_objects as go

from model.config import ModelArgs

from . import attention, experts, predictions, residual, router
from .arrays import future_mask
from .figures import without_first
from .tokens import labels

if TYPE_CHECKING:
    from app.core.session import View


def embedded_stream(view: View, block: int, **_) -> go.Figure | None:
    got = residual.embedded_stream(view.trace)
    return None if got is None else residual.embedded_stream_figure(got[0], got[1], labels(view))


def block_updates(view: View, block: int, skip_first: bool = False, **_) -> go.Figure | None:
    df = residual.block_updates(view.trace, block)
    return None if df is None else residual.block_updates_figure(df, block, skip_first)


def norm_rms(view: View, block: int, **_) -> go.Figure | None:
    df = residual.norm_rms(view.trace, block)
    return None if df is None else residual.norm_rms_figure(df, block)


def attention_pattern(view: View, block: int, head: int | None = None, skip_first: bool = False, **_) -> go.Figure | None:
    """``skip_first``: key 0 left out of the colours (the attention sink many heads park their mass on)."""
    z = attention.attention_pattern(view.trace, block, head)
    if z is None:
        return None
    which = "mean over heads" if head is None else f"head {head}"
    title = f"Block {block}: attention probabilities ({which})"
    if skip_first:
        z, title = without_first(z), title + "; key 0 left out"
    return attention.attention_figure(z, labels(view), title)


def index_scores(view: View, block: int, **_) -> go.Figure | None:
    got = attention.index_scores(view.trace, block)
    if got is None:
        return None
    scores, chosen = got
    k = min(view.config.index_topk, view.n_tokens)
    # mark whichever is rarer, so the scores stay visible: the selected keys, or (when most
    # visible keys are selected) the ones the sparse attention drops
    dropped = ~future_mask(len(chosen)) & ~chosen
    if dropped.sum() < chosen.sum():
        title = f"Block {block}: index scores I, keys outside the top {k} crossed (dropped)"
        return attention.index_scores_figure(scores, dropped, labels(view), title, marks="dropped")
    title = f"Block {block}: index scores I, the {k} selected keys per query circled"
    return attention.index_scores_figure(scores, chosen, labels(view), title)


def sparse_mask(view: View, block: int, **_) -> go.Figure | None:
    grid = attention.mask_categories(view.trace, block)
    if grid is None:
        return None
    return attention.sparse_mask_figure(grid, labels(view), f"Block {block}: the sparse attention mask M")


def mlp_update(view: View, block: int, skip_first: bool = False, **_) -> go.Figure | None:
    df = residual.block_updates(view.trace, block)
    return None if df is None else residual.mlp_update_figure(df, block, skip_first)


def router_scores(view: View, block: int, **_) -> go.Figure | None:
    r = router.routing(view.trace, block)
    if r is None or r.scores is None:
        return None
    return router.router_scores_figure(r, labels(view), view.config.experts_per_group)


def expert_weights(view: View, block: int, **_) -> go.Figure | None:
    df = experts.expert_weights(view.trace, block)
    return None if df is None else experts.expert_weights_figure(df, labels(view), block, view.config.n_routed_experts)


def next_token(view: View, block: int, **_) -> go.Figure | None:
    df = predictions.next_tokens(view.trace)
    return None if df is None else predictions.next_token_figure(df)


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


def applicable_block(scope: str, cfg: ModelArgs, block: int) -> tuple[int | None, str]:
    """The block a card of this scope can show, and a note when it is not the chosen one."""
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
