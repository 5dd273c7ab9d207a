"""A figure's margins, worked out before it is drawn: wide enough for its tick labels, axis titles,
colour bars and legend. Plotly's automargin (left on, as a safety net) grows a margin that is too
small by drawing the whole figure a second time, half of its drawing time in the browser; with
these margins it has nothing to grow. Estimates err wide: a few pixels of white cost nothing."""

from __future__ import annotations

import html
import math
import re
from typing import Any

CHAR = 0.65  # a glyph's width over the font size, generous: Source Sans averages ~0.5, a fallback font more
FONT = 12  # the figures' font size (topics.figures.TEMPLATE)
GAP = 12  # tick and padding between the plot and its labels
TITLE = 24  # an axis title's line and its standoff
SIDE = {"l": 10, "r": 20, "t": 10, "b": 10}  # the least margins: a number tick at the right end overhangs the plot
UPRIGHT = 10  # more labels than this on an x axis stand upright (tickangle -90), so their height is known
NUMBER = 5  # characters of a number tick, "0.005" or "12.5k"
BAR = 30 + 10 + GAP  # a colour bar's thickness, its padding and its ticks
BAR_OFFSET = 22  # a colour bar at plotly's default x = 1.02 of the plot's width, for a plot 1000 px wide
TAG = re.compile(r"</?(?:b|i|em|s|u|sup|sub|span|a)\b[^>]*>", re.IGNORECASE)  # what plotly renders as markup


def _chars(text: Any) -> int:
    """Characters drawn for a label: plotly renders tags (<b>, <br>) and entities (&lt;)."""
    return max((len(html.unescape(TAG.sub("", part))) for part in re.split(r"<br\s*/?>", str(text))), default=0)


def _px(texts, size: float) -> float:
    return max((_chars(t) for t in texts), default=NUMBER) * size * CHAR


def _ticks(name: str, axis: dict, traces: list[dict]) -> list | None:
    """The tick labels an axis draws: its ticktext or categories (every dtick-th), else the strings
    plotted on it; None for numbers."""
    if axis.get("ticktext") is not None:
        return list(axis["ticktext"])
    if axis.get("categoryarray") is not None:
        return list(axis["categoryarray"])[:: max(1, int(axis.get("dtick") or 1))]
    letter, ref = name[0], name[0] + name[5:]  # "xaxis2" -> "x", "x2"
    texts: list = []
    for trace in traces:
        values = trace.get(letter)
        if trace.get(f"{letter}axis", letter) != ref or values is None or isinstance(values, str) or len(values) == 0:
            continue
        values = list(values)  # a list, an array or a Series (whatever its index)
        if isinstance(values[0], str):
            texts.extend(values)
    return list(dict.fromkeys(texts)) or None


def _title_px(axis: dict) -> float:
    title = axis.get("title")
    text = title.get("text") if isinstance(title, dict) else title
    return TITLE if text else 0


def margins(traces: list[dict], layout: dict) -> dict:
    """``layout`` with margins its labels fit in, and upright labels on crowded x axes (so their height
    is known); the caller's own margins are kept as lower bounds."""
    layout = dict(layout)
    own = layout.get("margin", {})
    need = {side: max(least, own.get(side, 0)) for side, least in SIDE.items()}
    names = {f"{a.get('xaxis', 'x')}" for a in traces} | {f"{a.get('yaxis', 'y')}" for a in traces} | {"x", "y"}
    for ref in sorted(names):
        name = f"{ref[0]}axis{ref[1:]}"
        axis = dict(layout.get(name) or {})
        if axis.get("visible") is False or axis.get("showticklabels") is False:
            continue
        size = (axis.get("tickfont") or {}).get("size", FONT)
        texts = _ticks(name, axis, traces)
        if ref[0] == "y":
            side = "r" if axis.get("side") == "right" else "l"
            need[side] = max(need[side], _px(texts or [], size) + GAP + _title_px(axis))
            continue
        if texts is not None and len(texts) > UPRIGHT and "tickangle" not in axis:
            axis["tickangle"] = -90
        upright = texts is not None and axis.get("tickangle") in (-90, 90)
        tall = _px(texts, size) if upright else size * 1.4
        need["b"] = max(need["b"], tall + GAP + _title_px(axis))
        layout[name] = axis
    for trace in traces:
        bar = trace.get("colorbar") or (trace.get("marker") or {}).get("colorbar") or {}
        heat = trace.get("type") in ("heatmap", "contour", "histogram2d") and trace.get("showscale") is not False
        if heat or (trace.get("marker") or {}).get("showscale"):
            title = (bar.get("title") or {}).get("text", "")
            offset = 0 if bar.get("x") is not None else BAR_OFFSET
            ticks = [f"{t}." for t in bar.get("ticktext") or ()]  # an outlier's end "≥ X": its sign is wider than a digit
            need["r"] = max(need["r"], offset + BAR + max(_px([title, *ticks], FONT), NUMBER * FONT * CHAR))
    legend = layout.get("legend") or {}
    named = [t.get("name") for t in traces if t.get("name") and t.get("showlegend") is not False]
    if layout.get("showlegend") or (layout.get("showlegend") is None and len(named) > 1):
        if legend.get("orientation") == "v" and (legend.get("x") or 0) >= 1:
            need["r"] = max(need["r"], _px(named, FONT) + 60)
        else:
            need["t"] = max(need["t"], 44)
    layout["margin"] = {**own, **{side: math.ceil(px) + (side in "lrb") * 3 for side, px in need.items()}}
    return layout
