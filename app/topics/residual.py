"""The residual stream: the x every block reads and writes, how large it is, how much each block
turns it, and how big the attention and FFN updates are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import Key
from tracing.trace import Trace

from .arrays import site
from .figures import (
    COLORS,
    DIVERGING,
    FIRST_LEFT_OUT,
    figure,
    heat_height,
    heatmap,
    outlier_note,
    position_figure,
    positions,
    reversed_axis,
    robust_range,
    rows_figure,
    with_outliers,
    without_first,
)
from .tokens import token_texts


def embedded_stream(trace: Trace, max_dims: int = 256) -> tuple[np.ndarray, int] | None:
    """x_0 [T, min(d, max_dims)] and d."""
    x0 = site(trace, 0, "resid_pre")
    if x0 is None:
        return None
    return x0[:, :max_dims], x0.shape[1]


def block_updates(trace: Trace, block: int) -> pd.DataFrame | None:
    """Per position: |x_n|, |attention update|, |FFN update| (L2 norms)."""
    pre, mid, post = (site(trace, block, w) for w in ("resid_pre", "resid_mid", "resid_post"))
    if pre is None or mid is None or post is None:
        return None
    return pd.DataFrame(
        {
            "position": np.arange(trace.n_tokens),
            "token": token_texts(trace),
            "stream": np.linalg.norm(pre, axis=-1),
            "attention update": np.linalg.norm(mid - pre, axis=-1),
            "FFN update": np.linalg.norm(post - mid, axis=-1),
        }
    )


def norm_rms(trace: Trace, block: int) -> pd.DataFrame | None:
    """Per position: the RMS that attn_norm and ffn_norm divide by."""
    pre, mid = site(trace, block, "resid_pre"), site(trace, block, "resid_mid")
    if pre is None:
        return None
    out = {"position": np.arange(trace.n_tokens), "token": token_texts(trace), "attn_norm input": _rms(pre)}
    if mid is not None:
        out["ffn_norm input"] = _rms(mid)
    return pd.DataFrame(out)


def _rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=-1))


@dataclass
class ResidualGrids:
    rows: list[str]  # "x_0 embedding", "after block 0", ...
    norm: np.ndarray  # [L+1, T]
    cos_rows: list[str]
    cos: np.ndarray  # [L, T] cosine(x_{n+1}, x_n)
    layers: list[int]
    attn: np.ndarray  # [L, T] |attention update|
    ffn: np.ndarray  # [L, T] |FFN update|


def residual_grids(frame: pd.DataFrame, n_tokens: int) -> ResidualGrids | None:
    """From tables()['residual']: norms, cosines and update sizes as layer × position grids."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["block"].unique().tolist())

    def grid(column: str) -> np.ndarray:
        if column not in frame:
            return np.full((len(layers), n_tokens), np.nan)
        return frame.pivot(index="block", columns="position", values=column).loc[layers].to_numpy()

    post = grid("norm_post")
    first = grid("norm_pre")[:1] if "norm_pre" in frame else np.full((1, n_tokens), np.nan)
    return ResidualGrids(
        rows=["x₀ (embedding)", *[f"after block {i}" for i in layers]],
        norm=np.vstack([first, post]),
        cos_rows=[f"block {i}" for i in layers],
        cos=grid("cos_prev"),
        layers=layers,
        attn=grid("attn_update_norm"),
        ffn=grid("ffn_update_norm"),
    )


def embedded_stream_figure(z: np.ndarray, d: int, labels: list[str]) -> go.Figure:
    lim = float(np.nanmax(np.abs(z))) or 1.0
    heat = {
        "type": "heatmap",
        "z": z,
        "y": labels,
        "colorscale": DIVERGING,
        "zmid": 0,
        "zmin": -lim,
        "zmax": lim,
        "hovertemplate": "position %{y}<br>dim %{x}<br>x₀ = %{z:.4f}<extra></extra>",
        "colorbar": {"title": {"text": "x₀"}},
    }
    shown = f"first {z.shape[1]} of {d} dims" if z.shape[1] < d else f"all {d} dims"
    return figure(
        [heat],
        "The embedded stream x₀, one row per position",
        height=heat_height(len(labels)),
        yaxis=reversed_axis(**positions(labels, "position")),
        xaxis={"title": {"text": f"feature ({shown})"}},
    )


def block_updates_figure(df: pd.DataFrame, block: int, skip_first: bool = False) -> go.Figure:
    """Bars on a scale that stops above the bulk (the first token's stream often dwarfs the rest), the
    positions beyond it marked; ``skip_first`` leaves position 0 out."""
    series = [
        ("bar", "attention update", "|attention update|", COLORS["attention"]),
        ("bar", "FFN update", "|FFN update|", COLORS["ffn"]),
        ("line", "stream", "|x_n| (stream in)", COLORS["stream"]),
    ]
    title = f"Block {block}: update sizes per position"
    yaxis = {"title": {"text": "L2 norm"}}
    return position_figure(df, series, title, yaxis, robust="L2 norm", skip_first=skip_first, barmode="group")


def mlp_update_figure(df: pd.DataFrame, block: int, skip_first: bool = False) -> go.Figure:
    series = [("bar", "FFN update", "|MLP update|", COLORS["dense"]), ("line", "stream", "|x_n| (stream in)", COLORS["stream"])]
    title = f"Block {block}: size of the dense MLP's update per position"
    return position_figure(df, series, title, {"title": {"text": "L2 norm"}}, robust="L2 norm", skip_first=skip_first)


def norm_rms_figure(df: pd.DataFrame, block: int) -> go.Figure:
    series = [
        ("line", column, f"RMS of the {column}", color, ".4f")
        for column, color in (("attn_norm input", COLORS["attention"]), ("ffn_norm input", COLORS["ffn"]))
        if column in df
    ]
    yaxis = {"title": {"text": "RMS the norm divides by"}, "type": "log"}
    return position_figure(df, series, f"Block {block}: the stream's RMS at each norm", yaxis)


def residual_norms_figure(g: ResidualGrids, labels: list[str], skip_first: bool = False) -> go.Figure:
    """The stream's norm; a scale that stops below a dominating token (the first position's stream is
    often hundreds of times the rest), its cells marked and named in the title; ``skip_first`` leaves
    position 0 out of the colours."""
    z = without_first(g.norm) if skip_first else g.norm
    scale = robust_range(z)
    heat = heatmap(z, g.rows, "%{y}<br>position %{x}<br>|x| = %{z:.3f}", x=labels)
    title = "Residual stream norm |x| per block and position" + (FIRST_LEFT_OUT if skip_first else "")
    title += outlier_note(z, scale.outliers, labels, "|x|")
    return rows_figure([with_outliers(heat, scale, "|x|")], g.rows, title, positions(labels, "position"), lo=380, per=34)


def residual_cosine_figure(g: ResidualGrids, labels: list[str]) -> go.Figure:
    hover = "%{y}: cos(x_out, x_in)<br>position %{x}<br>cos = %{z:.4f}"
    heat = heatmap(g.cos, g.cos_rows, hover, x=labels, scale="cos", zmax=1)
    title = "Cosine between a block's output and its input"
    return rows_figure([heat], g.cos_rows, title, positions(labels, "position"), lo=380, per=34)


def update_sizes_figure(g: ResidualGrids) -> go.Figure:
    """Mean over positions (with the range) of the attention and FFN update norms, per block."""
    x = [f"block {i}" for i in g.layers]
    traces = []
    for grid, name, color in ((g.attn, "|attention update|", COLORS["attention"]), (g.ffn, "|FFN update|", COLORS["ffn"])):
        mean, lo, hi = np.nanmean(grid, axis=1), np.nanmin(grid, 1), np.nanmax(grid, 1)
        traces.append(
            {
                "type": "bar",
                "x": x,
                "y": mean,
                "name": name,
                "marker": {"color": color},
                "error_y": {"type": "data", "symmetric": False, "array": hi - mean, "arrayminus": mean - lo},
                "customdata": np.stack([lo, hi], -1),
                "hovertemplate": "%{x}<br>mean %{y:.3f} (min %{customdata[0]:.3f}, max %{customdata[1]:.3f})<extra>"
                + name
                + "</extra>",
            }
        )
    return figure(
        traces,
        "Update sizes per block: mean over positions, whiskers the range",
        barmode="group",
        yaxis={"title": {"text": "L2 norm"}},
    )


# the Residual page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("resid_skip_first", "Residual: the stream norm with position 0 left out", kept=True),
    Key("resid_updates_skip_first", "Residual: the block's update sizes with position 0 left out", kept=True),
)
