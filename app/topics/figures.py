"""The figures' common look. Each figure is built in one go from a list of traces and a layout dict
(:func:`figure`): plotly's incremental ``update_layout`` / ``add_vline`` / ``make_subplots`` cost
ten times more, and the app builds these on every block switch. Hovers name the tokens and the
values; axes name what they count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .margins import margins

SEQUENTIAL = "Viridis"
DIVERGING = "RdBu_r"
ATTN = "Blues"
COLORS = {
    "attention": "#4C78A8",
    "ffn": "#F58518",
    "stream": "#54A24B",
    "dense": "#72B7B2",
    "moe": "#E45756",
    "norm": "#BAB0AC",
    "marker": "#FF4B4B",
}
TICK_LIMIT = 40  # up to this many positions, axes show the tokens themselves
# The figures' own look, drawn as they are (app.ui.widgets.chart passes theme=None): Streamlit's theme
# would add 3.7 KB of template to each figure, merge more into it in the browser and turn on plotly's
# automargin, which draws a figure twice when a margin must grow (topics.margins sizes them instead).
# White, like a printed figure, so it reads the same in Streamlit's light and dark modes.
INK, GRID = "#31333F", "#E6EAF1"
TEMPLATE = {
    "layout": {
        "font": {"family": '"Source Sans", "Source Sans Pro", sans-serif', "size": 12, "color": INK},
        "paper_bgcolor": "white",
        "plot_bgcolor": "white",
        "colorway": ["#0068C9", "#83C9FF", "#FF2B2B", "#FFABAB", "#29B09D", "#7DEFA1", "#FF8700", "#FFD16A", "#6D3FC0"],
        "xaxis": {"gridcolor": GRID, "zerolinecolor": GRID, "linecolor": GRID, "automargin": True},
        "yaxis": {"gridcolor": GRID, "zerolinecolor": GRID, "linecolor": GRID, "automargin": True},
        "hoverlabel": {"bgcolor": "white", "bordercolor": GRID, "font": {"color": INK}},
    }
}
_LEGENDS = {
    "top": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "left", "x": 0},
    "right": {"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02},
}


def figure(traces: list[dict], title: str = "", height: int = 360, legend: str = "top", **layout: Any) -> go.Figure:
    """The shared look: title at the top left, the legend between it and the plot (or at the right)."""
    base: dict[str, Any] = {
        "template": TEMPLATE,
        "height": height,
        "margin": {"t": 72 if title else 30},  # the sides: topics.margins, from the labels
        "hoverlabel": {"font": {"family": "monospace"}},
        "legend": _LEGENDS[legend],
    }
    if title:
        base["title"] = {
            "text": title,
            "font": {"size": 14},
            "x": 0,
            "xanchor": "left",
            "y": 1,
            "yref": "container",
            "yanchor": "top",
            "pad": {"t": 8},
        }
    base.update(layout)
    return go.Figure(data=traces, layout=margins(traces, base))


def heat_height(rows: int, lo: int = 300, hi: int = 720, per: int = 16) -> int:
    return int(min(max(lo, rows * per + 110), hi))


def positions(labels: list[str], title: str, **extra: Any) -> dict:
    """An axis over token positions. Its categories are the labels ``12 ␣truth`` themselves, so hovers
    name the token with ``%{x}`` / ``%{y}`` and no per-cell text travels to the browser."""
    return {
        "title": {"text": title},
        "type": "category",
        "categoryorder": "array",
        "categoryarray": labels,
        "dtick": max(1, -(-len(labels) // TICK_LIMIT)),
        "tickfont": {"size": 10},
        **extra,
    }


def vlines(xs, color: str = "white", width: float = 2, dash: str = "solid", yref: str = "paper") -> list[dict]:
    return [
        {
            "type": "line",
            "x0": x,
            "x1": x,
            "y0": 0,
            "y1": 1,
            "xref": "x",
            "yref": yref,
            "line": {"color": color, "width": width, "dash": dash},
        }
        for x in xs
    ]


def group_lines(n_experts: int, per_group: int, **style: Any) -> list[dict]:
    """Lines between the expert groups of an expert axis."""
    return vlines([g * per_group - 0.5 for g in range(1, n_experts // per_group)], **style)


def right_axis(title: str, **axis: Any) -> dict:
    """A second y axis on the right, over the first, without its own grid."""
    return {"title": {"text": title}, "overlaying": "y", "side": "right", "showgrid": False, "rangemode": "tozero", **axis}


def reversed_axis(**axis: Any) -> dict:
    return {"autorange": "reversed", **axis}


def heatmap(z, rows: list[str], hover: str, x=None, scale: str | None = None, **extra: Any) -> dict:
    """A heatmap trace with named rows, sequential colours unless ``extra`` says otherwise. ``hover``
    is the hover text without plotly's trace box; ``scale`` titles the colour bar."""
    trace = {"type": "heatmap", "z": z, "y": rows, "colorscale": SEQUENTIAL, "hovertemplate": hover + "<extra></extra>"}
    if x is not None:
        trace["x"] = x
    if scale is not None:
        trace["colorbar"] = {"title": {"text": scale}}
    return {**trace, **extra}


def write_cells(trace: dict, text, n_positions: int) -> dict:
    """The trace with ``text`` written in its cells, when the positions are few enough to read it."""
    if n_positions <= TICK_LIMIT:
        trace.update(text=text, texttemplate="%{text}", textfont={"size": 10})
    return trace


def rows_figure(
    traces: list[dict], rows: list[str], title: str, xaxis: dict, lo: int = 300, per: int = 16, **layout: Any
) -> go.Figure:
    """Named rows (blocks, points in the network) from the top down, as tall as they need."""
    yaxis = reversed_axis(**({"dtick": 1, "type": "category"} if len(rows) <= TICK_LIMIT else {}))  # every row named
    return figure(traces, title, height=heat_height(len(rows), lo=lo, per=per), yaxis=yaxis, xaxis=xaxis, **layout)


FIRST_LEFT_OUT = "; position 0 left out"  # a title's word on a figure without the first position


def position_figure(
    df: pd.DataFrame,
    series: list[tuple],
    title: str,
    yaxis: dict,
    robust: str | None = None,
    skip_first: bool = False,
    **layout: Any,
) -> go.Figure:
    """Values per position of a frame with ``position`` and ``token`` columns, one trace per series:
    (``"bar"`` or ``"line"``, column, name, colour[, hover number format]). ``robust``: the measure's
    name, to draw it on :func:`robust_range` (the y axis stops above the bulk, the positions beyond
    it marked ▲ with their value and named in the title). ``skip_first``: position 0 left out (the
    title says so)."""
    if skip_first:
        df, title = df.iloc[1:], title + FIRST_LEFT_OUT
    names = [f"{p} {t}" for p, t in zip(df["position"], df["token"], strict=True)]
    marks = None
    if robust is not None and len(df):
        values = np.stack([df[s[1]].to_numpy(dtype=np.float64) for s in series])  # (series, T)
        scale = robust_range(values, lo=0.0)
        marks, axis = bar_outliers(names, values, scale, robust)
        yaxis = {**yaxis, **axis}
        title += outlier_note(values, scale.outliers, names, robust)
    traces = []
    for kind, column, name, color, *fmt in series:
        trace = {
            "x": names,
            "y": df[column],
            "name": name,
            "hovertemplate": "%{x}<br>" + name + ": %{y:" + (fmt[0] if fmt else ".3f") + "}<extra></extra>",
        }
        if kind == "bar":
            trace.update(type="bar", marker={"color": color})
        else:
            trace.update(type="scatter", mode="lines+markers", line={"color": color})
        traces.append(trace)
    if marks is not None:
        traces.append(marks)
    return figure(traces, title, xaxis=positions(names, "position"), yaxis=yaxis, **layout)


def robust_top(z, factor: float = 4.0) -> tuple[float | None, np.ndarray]:
    """A (rows x positions) heat map's top, and its outliers: when some positions' values exceed
    ``factor`` times the median position's largest (one dominating token, as the first position's
    stream), the scale stops at the largest of the other positions so the bulk stays readable, and
    the cells above it are returned (bool, z's shape) to be marked and named; otherwise (None, none)."""
    z = np.asarray(z, dtype=np.float64)
    finite = np.where(np.isfinite(z), z, np.nan)
    if z.ndim != 2 or not np.isfinite(finite).any():
        return None, np.zeros(z.shape, dtype=bool)
    peaks = np.nanmax(np.where(np.isfinite(finite), finite, -np.inf), axis=0)  # each position's largest
    typical = float(np.median(peaks[np.isfinite(peaks)]))
    loud = peaks > factor * typical if typical > 0 else np.zeros_like(peaks, dtype=bool)
    if not loud.any() or loud.all():
        return None, np.zeros(z.shape, dtype=bool)
    top = float(peaks[~loud].max())
    return top, np.isfinite(finite) & (finite > top)


def outlier_note(z, outliers: np.ndarray, labels: list[str], what: str) -> str:
    """``; position 0 ␣The beyond the scale (|x| up to 702.3, marked ▲)``: the title's word on outliers."""
    if not outliers.any():
        return ""
    columns = sorted(set(np.nonzero(outliers)[1].tolist()))
    named = ", ".join(labels[c] for c in columns[:3]) + (f" and {len(columns) - 3} more" if len(columns) > 3 else "")
    peak = np.asarray(z, dtype=np.float64)[outliers]
    extreme = float(peak[np.argmax(np.abs(peak))])
    return f"; {named} beyond the scale ({what} up to {extreme:.4g}, marked ▲)"


@dataclass(frozen=True)
class Scale:
    """A colour (or bar) range that shows the bulk of the data: ``lo``..``hi``, the values beyond it
    (bool, the data's shape) to be marked and named, and whether it is a clipped one."""

    lo: float
    hi: float
    outliers: np.ndarray

    @property
    def clipped(self) -> bool:
        return bool(self.outliers.any())


def _finite(z) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    return np.where(np.isfinite(z), z, np.nan)


def robust_range(z, lo: float | None = None, factor: float = 4.0) -> Scale:
    """Sequential data (rows x positions, or one row): from ``lo`` (default the data's least) up to the
    largest value outside the dominating positions (:func:`robust_top`), or to the data's largest when
    none dominates. One rule for every heat map and bar chart of sizes."""
    z = _finite(np.atleast_2d(z))
    if not np.isfinite(z).any():
        return Scale(0.0 if lo is None else lo, 1.0, np.zeros(z.shape, dtype=bool))
    top, outliers = robust_top(z, factor)
    low = float(np.nanmin(z)) if lo is None else lo
    high = float(np.nanmax(z)) if top is None else top
    return Scale(low, high if high > low else low + 1.0, outliers)


def symmetric_range(z, factor: float = 4.0) -> Scale:
    """Diverging data around 0: ±the largest |value| outside the dominating positions (robust_top of
    |z|), or ±max|v| when none dominates; so 0 stays white and the bulk keeps its colours."""
    z = _finite(np.atleast_2d(z))
    if not np.isfinite(z).any():
        return Scale(-1.0, 1.0, np.zeros(z.shape, dtype=bool))
    top, outliers = robust_top(np.abs(z), factor)
    bound = float(np.nanmax(np.abs(z))) if top is None else top
    bound = bound or 1.0
    return Scale(-bound, bound, outliers)


def colour_bar(scale: Scale, title: str, symmetric: bool = False) -> dict:
    """A colour bar whose ends say ``≥ X`` (and ``≤ −X``) when the scale stops before the data."""
    bar: dict[str, Any] = {"title": {"text": title}}
    if scale.clipped:
        ticks = np.linspace(scale.lo, scale.hi, 5)
        text = [f"{v:.3g}" for v in ticks]
        text[-1] = f"≥ {scale.hi:.3g}"
        if symmetric:
            text[0] = f"≤ {scale.lo:.3g}"
        bar.update(tickvals=ticks.tolist(), ticktext=text)
    return bar


def with_outliers(trace: dict, scale: Scale, title: str, symmetric: bool = False) -> dict:
    """A heatmap trace drawn on ``scale``: its range, a colour bar saying where the scale stops, and
    each cell beyond the scale written ▲ (the caption names them: :func:`outlier_note`)."""
    trace.update(zmin=scale.lo, zmax=scale.hi, colorbar=colour_bar(scale, title, symmetric))
    if symmetric:
        trace["zmid"] = 0
    if scale.clipped:
        trace.update(text=np.where(scale.outliers, "▲", ""), texttemplate="%{text}", textfont={"size": 11})
    return trace


def bar_outliers(x: list[str], values: np.ndarray, scale: Scale, what: str) -> tuple[dict | None, dict]:
    """Bars (series x positions ``values``) on ``scale``: the y axis stops a little above the bulk and
    each bar beyond it gets a ▲ with its value at the top (a scatter trace, its hover naming it); the
    trace, or None when nothing is clipped, and the y axis range."""
    axis = {"range": [min(0.0, scale.lo), scale.hi * 1.12]}
    if not scale.clipped:
        return None, {"rangemode": "tozero"}
    columns = sorted(set(np.nonzero(scale.outliers)[1].tolist()))
    peaks = [float(np.nanmax(values[:, c])) for c in columns]
    marks = {
        "type": "scatter",
        "mode": "markers+text",
        "x": [x[c] for c in columns],
        "y": [scale.hi * 1.06] * len(columns),
        "text": [f"▲ {v:.3g}" for v in peaks],
        "textposition": "middle right",
        "textfont": {"size": 10},
        "marker": {"symbol": "triangle-up", "size": 10, "color": COLORS["marker"]},
        "name": "beyond the scale",
        "customdata": peaks,
        "hovertemplate": "%{x}<br>" + what + " = %{customdata:.4g} (beyond the scale)<extra></extra>",
    }
    return marks, axis


def without_first(z) -> np.ndarray:
    """A (rows x positions) grid with the first position blanked: its own scale for the rest."""
    z = np.array(z, dtype=np.float64)
    z[..., 0] = np.nan
    return z


def cells_note(n_positions: int, written: str) -> str:
    """The title's word on cell text: what is written in the cells, or why nothing is."""
    if n_positions <= TICK_LIMIT:
        return f" ({written} in each cell)"
    return f" (more than {TICK_LIMIT} positions: hover for {written})"
