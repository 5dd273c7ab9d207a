"""The figures' common look. Each figure is built in one go from a list of traces and a layout dict
(:func:`figure`): plotly's incremental ``update_layout`` / ``add_vline`` / ``make_subplots`` cost
ten times more, and the app builds these on every block switch. Hovers name the tokens and the
values; axes name what they count.
"""

from __future__ import annotations

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
# The figures' own look, drawn as they are (app.widgets.chart passes theme=None): Streamlit's theme
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
    return figure(traces, title, height=heat_height(len(rows), lo=lo, per=per), yaxis=reversed_axis(), xaxis=xaxis, **layout)


def position_figure(df: pd.DataFrame, series: list[tuple], title: str, yaxis: dict, **layout: Any) -> go.Figure:
    """Values per position of a frame with ``position`` and ``token`` columns, one trace per series:
    (``"bar"`` or ``"line"``, column, name, colour[, hover number format])."""
    names = [f"{p} {t}" for p, t in zip(df["position"], df["token"], strict=True)]
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
    """``; position 0 ␣The above the scale (|x| up to 702.3, marked ▲)``: the title's word on outliers."""
    if not outliers.any():
        return ""
    columns = sorted(set(np.nonzero(outliers)[1].tolist()))
    named = ", ".join(labels[c] for c in columns[:3]) + (f" and {len(columns) - 3} more" if len(columns) > 3 else "")
    return f"; {named} above the scale ({what} up to {float(np.nanmax(np.asarray(z)[outliers])):.4g}, marked ▲)"
