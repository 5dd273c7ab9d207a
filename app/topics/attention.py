"""Attention and the lightning indexer: the index scores and the keys they select, the sparse mask,
where attention went, and how much of the dense attention mass the selection keeps (recall)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import POSITION, Key
from tracing.tables.grid import index_grid
from tracing.trace import Trace

from .arrays import future_mask, site
from .figures import ATTN, COLORS, SEQUENTIAL, figure, heat_height, heatmap, positions, reversed_axis, rows_figure
from .tokens import token_texts

MASK_NAMES = ("future (causal mask)", "visible, not selected (−∞)", "selected (0)")


def attention_pattern(trace: Trace, block: int, head: int | None = None) -> np.ndarray | None:
    """[T, S] attention probabilities after the sparse mask: mean over heads, or one head."""
    probs = site(trace, block, "attn.probs_mean" if head is None else "attn.probs")
    if probs is None:
        return None
    z = (probs if head is None else probs[:, head, :]).astype(np.float64)  # a copy
    z[future_mask(z.shape[0])] = np.nan
    return z


def recorded_heads(trace: Trace, block: int) -> int:
    probs = trace.site(block, "attn.probs")
    return 0 if probs is None else int(probs.shape[1])


def index_scores(trace: Trace, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """I [T, S] (NaN where masked) and the selection as a bool [T, S]."""
    scores = site(trace, block, "attn.indexer.scores")
    if scores is None:
        return None
    z = scores.astype(np.float64)
    z[~np.isfinite(z)] = np.nan
    return z, selected_keys(trace, block)


def selected_keys(trace: Trace, block: int) -> np.ndarray:
    """[T, S] the keys the indexer kept for each query (none where the trace lacks the selection)."""
    n = trace.n_tokens
    topk = site(trace, block, "attn.indexer.topk_indices")
    chosen = np.zeros((n, n), dtype=bool) if topk is None else index_grid(topk, n)
    return chosen & ~future_mask(n)


def mask_categories(trace: Trace, block: int) -> np.ndarray | None:
    """[T, S]: 0 future, 1 visible but dropped by the indexer, 2 selected."""
    if trace.site(block, "attn.indexer.topk_indices") is None:
        return None
    n = trace.n_tokens
    grid = np.ones((n, n), dtype=np.int64)
    grid[future_mask(n)] = 0
    grid[selected_keys(trace, block)] = 2
    return grid


def recall_grid(frame: pd.DataFrame | None, n_tokens: int) -> tuple[list[int], np.ndarray] | None:
    """From tables()['indexer_recall']: layers and recall [L, T]."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["block"].unique().tolist())
    return layers, frame.pivot(index="block", columns="query", values="recall").loc[layers].to_numpy()


def query_profile(trace: Trace, block: int, query: int) -> pd.DataFrame | None:
    """For one query: per visible key, the index score, whether selected, and the attention probability."""
    got = index_scores(trace, block)
    if got is None:
        return None
    scores, chosen = got
    keys = np.arange(query + 1)
    out = pd.DataFrame(
        {
            "key": keys,
            "token": [token_texts(trace)[k] for k in keys],
            "index score": scores[query, keys],
            "selected": chosen[query, keys],
        }
    )
    probs = attention_pattern(trace, block)
    if probs is not None:
        out["attention"] = probs[query, keys]
    return out


def _pair_heatmap(z, labels, colorscale, value_name, zmin=None, zmax=None, fmt=".4f") -> dict:
    return {
        "type": "heatmap",
        "z": z,
        "x": labels,
        "y": labels,
        "colorscale": colorscale,
        "zmin": zmin,
        "zmax": zmax,
        "hovertemplate": "query %{y}<br>key %{x}<br>" + value_name + " = %{z:" + fmt + "}<extra></extra>",
        "colorbar": {"title": {"text": value_name}},
    }


def _pair_figure(traces: list[dict], labels: list[str], title: str, **layout: Any) -> go.Figure:
    return figure(
        traces,
        title,
        height=heat_height(len(labels), lo=360, hi=760, per=14),
        yaxis=reversed_axis(**positions(labels, "query position")),
        xaxis=positions(labels, "key position"),
        **layout,
    )


def attention_figure(z: np.ndarray, labels: list[str], title: str) -> go.Figure:
    return _pair_figure([_pair_heatmap(z, labels, ATTN, "p", zmin=0)], labels, title)


def index_scores_figure(z: np.ndarray, marked: np.ndarray, labels: list[str], title: str, marks: str = "selected") -> go.Figure:
    """Index scores with the ``marked`` (query, key) cells drawn over them: the selected keys
    (circles), or the visible keys the top-k drops (crosses)."""
    q, k = np.nonzero(marked)
    names = np.asarray(labels, dtype=object)
    marks = {
        "type": "scatter",
        "x": names[k],
        "y": names[q],
        "mode": "markers",
        "name": f"{marks} key",
        "marker": {
            "symbol": "circle-open" if marks == "selected" else "x-thin-open",
            "size": 7 if len(labels) <= 64 else 4,
            "color": COLORS["marker"],
            "line": {"width": 1.5},
        },
        "hovertemplate": f"{marks}<br>query %{{y}}<br>key %{{x}}<extra></extra>",
    }
    return _pair_figure([_pair_heatmap(z, labels, SEQUENTIAL, "I", fmt=".3f"), marks], labels, title, showlegend=True)


def sparse_mask_figure(grid: np.ndarray, labels: list[str], title: str) -> go.Figure:
    """One flat-coloured layer per kind of entry (future, dropped, selected), so the hover names it."""
    colors = ("#E6E6E6", "#F2B8B5", "#1F77B4")
    traces = []
    for value, (name, color) in enumerate(zip(MASK_NAMES, colors, strict=True)):
        traces.append(
            {
                "type": "heatmap",
                "z": np.where(grid == value, 1.0, np.nan),
                "x": labels,
                "y": labels,
                "colorscale": [[0, color], [1, color]],
                "showscale": False,
                "name": name,
                "hovertemplate": "query %{y}<br>key %{x}<br>" + name + "<extra></extra>",
            }
        )
    # legend entries (heatmaps have none)
    traces += [
        {
            "type": "scatter",
            "x": [None],
            "y": [None],
            "mode": "markers",
            "name": name,
            "marker": {"symbol": "square", "size": 12, "color": color},
        }
        for name, color in zip(MASK_NAMES, colors, strict=True)
    ]
    return _pair_figure(traces, labels, title, showlegend=True)


def recall_figure(layers: list[int], z: np.ndarray, labels: list[str]) -> go.Figure:
    rows = [f"block {i}" for i in layers]
    scale = {"title": {"text": "recall"}, "x": 1.0, "xanchor": "left"}
    low = float(np.nanmin(z)) if np.isfinite(z).any() else 0.0
    low = min(np.floor(low * 100) / 100, 0.99)  # a scale fitted to the shares (often 0.9-1), not 0-1
    heat = heatmap(z, rows, "%{y} · query %{x}<br>recall %{z:.4f}", x=labels, zmin=low, zmax=1, colorbar=scale)
    means = {
        "type": "bar",
        "x": np.nanmean(z, 1),
        "y": rows,
        "orientation": "h",
        "xaxis": "x2",
        "marker": {"color": COLORS["attention"]},
        "name": "mean recall",
        "hovertemplate": "%{y}: mean recall %{x:.4f}<extra></extra>",
    }
    return rows_figure(
        [heat, means],
        rows,
        f"Indexer recall of the dense attention mass per query and block (colours {low:g} to 1; right: mean over queries)",
        positions(labels, "query position", domain=[0, 0.8]),
        per=40,
        showlegend=False,
        xaxis2={"domain": [0.84, 1], "range": [low, 1], "title": {"text": "mean"}},
    )


def query_profile_figure(df: pd.DataFrame, query: int, token: str, block: int) -> go.Figure:
    custom = [f"{k} {t}" for k, t in zip(df["key"], df["token"], strict=True)]
    traces = []
    if "attention" in df:
        traces.append(
            {
                "type": "bar",
                "x": custom,
                "y": df["attention"],
                "name": "attention p (mean over heads)",
                "marker": {"color": np.where(df["selected"], COLORS["attention"], "#C7C7C7")},
                "hovertemplate": "key %{x}<br>p = %{y:.4f}<extra></extra>",
            }
        )
    traces.append(
        {
            "type": "scatter",
            "x": custom,
            "y": df["index score"],
            "yaxis": "y2",
            "name": "index score I",
            "mode": "lines+markers",
            "line": {"color": COLORS["ffn"]},
            "marker": {"symbol": np.where(df["selected"], "circle", "x"), "size": 8},
            "customdata": np.where(df["selected"], "selected", "not selected"),
            "hovertemplate": "key %{x}<br>I = %{y:.3f} (%{customdata})<extra></extra>",
        }
    )
    return figure(
        traces,
        f"Block {block}, query {query} {token}: grey bars are keys the indexer dropped",
        xaxis=positions(custom, "key position"),
        yaxis={"title": {"text": "attention probability"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "index score"}, "overlaying": "y", "side": "right", "showgrid": False},
    )


def indexer_quality(table: pd.DataFrame, index_topk: int) -> pd.DataFrame | None:
    """Per block, over the queries that see more keys than the indexer keeps (where it drops any):
    mean recall, mean KL of its distribution from the dense one, mean overlap with the block before."""
    if table.empty:
        return None
    pruned = table[table["query"] >= index_topk]
    if pruned.empty:
        return None
    columns = [c for c in ("recall", "kl", "overlap_prev") if c in pruned]
    return pruned.groupby("block")[columns].mean().reset_index()


# --- this prompt's sinks -----------------------------------------------------------------------------------
def sinks_grid(frame: pd.DataFrame | None) -> tuple[list[int], np.ndarray] | None:
    """From tables()['sinks']: its blocks and their share kept from afar per key position
    [blocks, S'], S' the keys some query is index_topk or more positions after."""
    if frame is None or frame.empty:
        return None
    blocks = sorted(frame["block"].unique().tolist())
    return blocks, frame.pivot(index="block", columns="position", values="share").loc[blocks].to_numpy()


def sinks_figure(blocks: list[int], share: np.ndarray, labels: list[str], index_topk: int) -> go.Figure:
    rows = [f"block {b}" for b in blocks]
    trace = heatmap(
        share,
        rows,
        "%{y}, key %{x}<br>kept by %{z:.0%} of the queries at least " + f"{index_topk} positions later",
        x=labels[: share.shape[1]],
        scale="share kept",
        zmin=0,
        zmax=1,
    )
    return figure(
        [trace],
        f"Keys kept from afar: the share of the queries {index_topk} or more positions later that kept each key",
        height=heat_height(len(rows), per=22),
        yaxis=reversed_axis(),
        xaxis=positions(labels[: share.shape[1]], "key position"),
    )


# the Attention page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("query", "Attention: the query position", kept=True, link=POSITION),
    Key("attention_head", "Attention: the head", kept=True),
    Key("attention_sinks_csv", "Attention: the prompt's sinks table's CSV download"),
    Key("attention_skip_first", "Attention: the pattern with key 0 left out", kept=True),
)
