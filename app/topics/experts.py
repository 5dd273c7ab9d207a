"""The experts: which ones each token went to and with what weight, how much the routed and the
shared experts write, and the load per expert across the MoE blocks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracing.trace import Trace

from .arrays import site
from .figures import (
    COLORS,
    TICK_LIMIT,
    figure,
    heatmap,
    outlier_note,
    position_figure,
    positions,
    robust_range,
    rows_figure,
    with_outliers,
)
from .tokens import token_texts


def expert_weights(trace: Trace, block: int) -> pd.DataFrame | None:
    """Long frame: per position and chosen expert, its weight and rank."""
    idx = site(trace, block, "ffn.gate.topk_indices")
    if idx is None:
        return None
    w = site(trace, block, "ffn.gate.topk_weights")
    n, k = idx.shape
    per_group = trace.config.experts_per_group
    tokens = token_texts(trace)
    return pd.DataFrame(
        {
            "position": np.repeat(np.arange(n), k),
            "token": np.repeat(np.asarray(tokens, dtype=object), k),
            "expert": idx.ravel(),
            "group": idx.ravel() // per_group,
            "rank": np.tile(np.arange(k), n),
            "weight": w.ravel() if w is not None else np.full(n * k, np.nan),
        }
    )


def routed_shared(trace: Trace, block: int) -> pd.DataFrame | None:
    routed = site(trace, block, "ffn.routed_out")
    shared = site(trace, block, "ffn.shared_out")
    if routed is None or shared is None:
        return None
    return pd.DataFrame(
        {
            "position": np.arange(trace.n_tokens),
            "token": token_texts(trace),
            "routed experts": np.linalg.norm(routed, axis=-1),
            "shared expert": np.linalg.norm(shared, axis=-1),
        }
    )


def load_grid(frame: pd.DataFrame | None) -> tuple[list[int], np.ndarray, np.ndarray | None] | None:
    """From tables()['expert_load']: MoE blocks, tokens per expert [L, E], mean weight [L, E]."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["block"].unique().tolist())
    counts = frame.pivot(index="block", columns="expert", values="count").loc[layers].to_numpy()
    weights = (
        frame.pivot(index="block", columns="expert", values="mean_weight").loc[layers].to_numpy()
        if "mean_weight" in frame
        else None
    )
    return layers, counts, weights


def expert_tokens(trace: Trace, block: int) -> np.ndarray | None:
    """Tokens routed to each expert of a MoE block [E]."""
    idx = site(trace, block, "ffn.gate.topk_indices")
    if idx is None:
        return None
    return np.bincount(idx[idx >= 0].ravel(), minlength=trace.config.n_routed_experts)


def busiest_experts(trace: Trace, block: int, n: int = 5) -> list[tuple[int, int]]:
    """The ``n`` experts of a block that received the most tokens, busiest first: (expert, tokens)."""
    counts = expert_tokens(trace, block)
    if counts is None:
        return []
    order = np.argsort(-counts, kind="stable")[:n]
    return [(int(e), int(counts[e])) for e in order if counts[e] > 0]


def expert_weights_figure(df: pd.DataFrame, labels: list[str], block: int, n_experts: int) -> go.Figure:
    """Stacked bars per position, one segment per chosen expert (colour: expert, best first at the bottom)."""
    palette = np.asarray(_palette(n_experts), dtype=object)
    traces = []
    for rank, part in df.groupby("rank", sort=True):
        trace = {
            "type": "bar",
            "x": np.asarray(labels, dtype=object)[part["position"].to_numpy()],
            "y": part["weight"],
            "name": f"choice {rank + 1}",
            "marker": {"color": palette[part["expert"].to_numpy()], "line": {"color": "white", "width": 0.5}},
            "customdata": np.stack([part["expert"], part["group"]], -1),
            "hovertemplate": "token %{x}<br>expert %{customdata[0]} (group %{customdata[1]}), choice "
            + str(rank + 1)
            + "<br>weight %{y:.4f}<extra></extra>",
            "showlegend": False,
        }
        if len(labels) <= TICK_LIMIT:
            trace.update(text=part["expert"].astype(str), textposition="inside", insidetextanchor="middle")
        traces.append(trace)
    written = "the numbers: expert" if len(labels) <= TICK_LIMIT else f"over {TICK_LIMIT} positions: hover for the expert"
    return figure(
        traces,
        f"Block {block}: chosen experts and their weights ({written})",
        height=420,
        barmode="stack",
        xaxis=positions(labels, "position"),
        yaxis={"title": {"text": "gating weight, stacked"}},
    )


def _palette(n: int) -> list[str]:
    import plotly.colors as pc

    base = pc.qualitative.Dark24 + pc.qualitative.Light24
    return [base[i % len(base)] for i in range(n)]


def routed_shared_figure(df: pd.DataFrame, block: int, skip_first: bool = False) -> go.Figure:
    """Both outputs' sizes per position on a scale that stops above the bulk (the first token's outputs
    are often far larger), the positions beyond it marked; ``skip_first`` leaves position 0 out."""
    series = [
        ("bar", "routed experts", "|routed experts|", COLORS["moe"]),
        ("bar", "shared expert", "|shared expert|", COLORS["dense"]),
    ]
    title = f"Block {block}: routed vs shared expert output size"
    yaxis = {"title": {"text": "L2 norm of the output"}}
    return position_figure(df, series, title, yaxis, robust="L2 norm", skip_first=skip_first, height=320, barmode="group")


def expert_load_figure(layers: list[int], counts: np.ndarray, weights: np.ndarray | None, n_tokens: int) -> go.Figure:
    rows = [f"block {i}" for i in layers]
    hover = "%{y} · expert %{x}<br>%{z} of " + str(n_tokens) + " tokens<br>mean weight %{customdata:.4f}"
    custom = weights if weights is not None else np.zeros_like(counts, dtype=float)
    scale = robust_range(counts, lo=0.0)
    heat = with_outliers(heatmap(counts, rows, hover, customdata=custom), scale, "tokens")
    experts = [f"expert {e}" for e in range(counts.shape[1])]
    title = "Expert load: tokens routed to each expert, per MoE block" + outlier_note(counts, scale.outliers, experts, "tokens")
    return rows_figure([heat], rows, title, {"title": {"text": "routed expert"}}, per=32)
