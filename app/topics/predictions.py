"""What the model predicts: the next token after the last position, and the logit lens (the final
norm and the output head read from each block's output)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracing.tables.frames import logit_lens_table, next_token_table
from tracing.trace import Trace

from .figures import COLORS, cells_note, figure, heatmap, positions, reversed_axis, rows_figure, write_cells
from .tokens import show_token


@dataclass
class Lens:
    layers: list[int]
    top1: np.ndarray  # [L, T] token strings
    prob: np.ndarray  # [L, T]
    hover: np.ndarray  # [L, T] "tok 0.41<br>tok 0.12 ..."


def logit_lens(trace: Trace) -> Lens | None:
    frame = logit_lens_table(trace)
    if frame.empty:
        return None
    layers = sorted(frame["block"].unique().tolist())
    n, top = trace.n_tokens, int(frame["rank"].max()) + 1
    names = np.asarray([show_token(t) for t in frame["predicted"]], dtype=object).reshape(len(layers), n, top)
    probs = (
        frame["probability"].to_numpy().reshape(len(layers), n, top)
        if "probability" in frame
        else np.full((len(layers), n, top), np.nan)
    )
    hover = np.empty((len(layers), n), dtype=object)
    for li in range(len(layers)):
        for t in range(n):
            hover[li, t] = "<br>".join(f"{names[li, t, r]}  {probs[li, t, r]:.3f}" for r in range(top))
    top1 = np.asarray([show_token(t, limit=10) for t in frame["predicted"]], dtype=object).reshape(len(layers), n, top)
    return Lens(layers, top1[:, :, 0], probs[:, :, 0], hover)


def next_tokens(trace: Trace, top: int = 10) -> pd.DataFrame | None:
    frame = next_token_table(trace, top)
    if frame.empty:
        return None
    frame = frame.copy()
    frame["shown"] = [show_token(t) for t in frame["token"]]
    return frame


def logit_lens_figure(lens: Lens, labels: list[str]) -> go.Figure:
    rows = [f"after block {i}" for i in lens.layers]
    hover = "%{y} · position %{x}<br><b>top tokens</b><br>%{customdata}"
    heat = heatmap(lens.prob, rows, hover, x=labels, scale="p(top 1)", zmin=0, zmax=1, customdata=lens.hover)
    title = "Logit lens: the top next token read from each block's output" + cells_note(len(labels), "the top token")
    xaxis = positions(labels, "position (predicting the next token)")
    return rows_figure([write_cells(heat, lens.top1, len(labels))], rows, title, xaxis, lo=320, per=48)


def next_token_figure(df: pd.DataFrame) -> go.Figure:
    bar = {
        "type": "bar",
        "x": df["probability"],
        "y": [f"{r + 1}. {t}" for r, t in zip(df["rank"], df["shown"], strict=True)],
        "orientation": "h",
        "marker": {"color": COLORS["attention"]},
        "customdata": np.stack([df["token_id"], df["logit"]], -1),
        "hovertemplate": "%{y}<br>p = %{x:.4f}<br>id %{customdata[0]}, logit %{customdata[1]:.3f}<extra></extra>",
    }
    return figure(
        [bar],
        "Next token after the last position",
        height=110 + 26 * len(df),
        yaxis=reversed_axis(),
        xaxis={"title": {"text": "probability"}},
    )
