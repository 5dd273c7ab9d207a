"""Plotly figures. Inputs are the shaped values of :mod:`app.shaping`; nothing here reads a trace or
draws into Streamlit. Hovers name the tokens and the values; axes name what they count.

Each figure is built in one go from a list of traces and a layout dict (``_figure``): plotly's
incremental ``update_layout`` / ``add_vline`` / ``make_subplots`` cost ten times more, and the app
builds these on every block switch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from model.config import ModelArgs

from .shaping import MASK_NAMES, BiasEffect, Drift, Lens, LensChange, ResidualGrids, Routing

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
_LEGENDS = {
    "top": {"orientation": "h", "yanchor": "bottom", "y": 1.0, "xanchor": "left", "x": 0},
    "right": {"orientation": "v", "yanchor": "top", "y": 1, "xanchor": "left", "x": 1.02},
}


def _figure(traces: list[dict], title: str = "", height: int = 360, legend: str = "top", **layout: Any) -> go.Figure:
    """The shared look: title at the top left, the legend between it and the plot (or at the right)."""
    base: dict[str, Any] = {
        "height": height,
        "margin": {"l": 10, "r": 10, "t": 72 if title else 30, "b": 10},
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
    return go.Figure(data=traces, layout=base)


def _heat_height(rows: int, lo: int = 300, hi: int = 720, per: int = 16) -> int:
    return int(min(max(lo, rows * per + 110), hi))


def _positions(labels: list[str], title: str, **extra: Any) -> dict:
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


def _vlines(xs, color: str = "white", width: float = 2, dash: str = "solid", yref: str = "paper") -> list[dict]:
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


def _reversed(**axis: Any) -> dict:
    return {"autorange": "reversed", **axis}


# --- model map ----------------------------------------------------------------------------------------------
def block_map(args: ModelArgs, per_block: pd.DataFrame, chosen: int | None = None) -> go.Figure:
    """One column per block, its four sub-layers as rows; colour tells dense from MoE."""
    rows = ["attn_norm", "MLA + indexer", "ffn_norm", "FFN"]
    n = args.n_layers
    kind = np.zeros((4, n))
    text = np.empty((4, n), dtype=object)
    hover = np.empty((4, n), dtype=object)
    counts = {(b, c): p for b, c, p in per_block.itertuples(index=False)}
    for b in range(n):
        moe = args.is_moe(b)
        mla, indexer = counts.get((b, "attention"), 0), counts.get((b, "indexer"), 0)
        norms = counts.get((b, "block_norms"), 0) // 2
        ffn_parts = ["router", "routed_experts", "shared_experts"] if moe else ["dense_mlp"]
        ffn = sum(counts.get((b, c), 0) for c in ffn_parts)
        if moe:
            ffn_info = (
                f"block {b} MoE<br>router {counts.get((b, 'router'), 0):,} · {args.n_routed_experts} routed experts "
                f"{counts.get((b, 'routed_experts'), 0):,} · shared {counts.get((b, 'shared_experts'), 0):,}"
                f"<br>{ffn:,} params, {args.n_activated_experts} routed experts active per token"
            )
        else:
            ffn_info = f"block {b} dense MLP<br>{ffn:,} params"
        cells = [
            (0.0, "norm", f"block {b} attn_norm<br>RMSNorm, {norms:,} params"),
            (1.0, "MLA", f"block {b} attention<br>MLA {mla:,} + indexer {indexer:,} = {mla + indexer:,} params"),
            (0.0, "norm", f"block {b} ffn_norm<br>RMSNorm, {norms:,} params"),
            (3.0 if moe else 2.0, "MoE" if moe else "MLP", ffn_info),
        ]
        for r, (value, label, info) in enumerate(cells):
            kind[r, b] = value
            text[r, b] = label if n <= 16 else ""
            hover[r, b] = info
    scale = [
        [0.0, COLORS["norm"]],
        [0.25, COLORS["norm"]],
        [0.25, COLORS["attention"]],
        [0.5, COLORS["attention"]],
        [0.5, COLORS["dense"]],
        [0.75, COLORS["dense"]],
        [0.75, COLORS["moe"]],
        [1.0, COLORS["moe"]],
    ]
    heat = {
        "type": "heatmap",
        "z": kind,
        "x": list(range(n)),
        "y": rows,
        "text": text,
        "texttemplate": "%{text}",
        "customdata": hover,
        "hovertemplate": "%{customdata}<extra></extra>",
        "colorscale": scale,
        "zmin": 0,
        "zmax": 3,
        "showscale": False,
        "xgap": 3,
        "ygap": 3,
    }
    shapes = []
    if chosen is not None:
        shapes.append(
            {
                "type": "rect",
                "x0": chosen - 0.5,
                "x1": chosen + 0.5,
                "y0": -0.5,
                "y1": 3.5,
                "line": {"color": "black", "width": 2},
            }
        )
    return _figure(
        [heat],
        height=240,
        shapes=shapes,
        yaxis=_reversed(),
        xaxis={"title": {"text": "block (teal: dense MLP · red: MoE)"}, "dtick": 1 if n <= 32 else 5},
    )


def params_bars(frame: pd.DataFrame) -> go.Figure:
    """Total and per-token activated parameters per component, log scale."""
    traces = []
    for column, color, name in (("total", "#4C78A8", "total"), ("activated", "#F58518", "activated per token")):
        traces.append(
            {
                "type": "bar",
                "y": frame["component"],
                "x": frame[column].where(frame[column] > 0),
                "orientation": "h",
                "name": name,
                "marker": {"color": color},
                "customdata": np.stack([frame[column], frame["share"] * 100], axis=-1),
                "hovertemplate": "%{y}<br>"
                + name
                + ": %{customdata[0]:,}<br>%{customdata[1]:.2f}% of all parameters<extra></extra>",
            }
        )
    return _figure(
        traces,
        height=60 + 34 * len(frame),
        barmode="group",
        xaxis={"type": "log", "title": {"text": "parameters (log scale)"}},
        yaxis=_reversed(),
    )


# --- residual stream ----------------------------------------------------------------------------------------
def embedded_stream(z: np.ndarray, d: int, labels: list[str]) -> go.Figure:
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
    return _figure(
        [heat],
        "The embedded stream x₀, one row per position",
        height=_heat_height(len(labels)),
        yaxis=_reversed(**_positions(labels, "position")),
        xaxis={"title": {"text": f"feature ({shown})"}},
    )


def _position_bar(df: pd.DataFrame, column: str, name: str, color: str, custom: list[str]) -> dict:
    return {
        "type": "bar",
        "x": custom,
        "y": df[column],
        "name": name,
        "marker": {"color": color},
        "hovertemplate": "%{x}<br>" + name + ": %{y:.3f}<extra></extra>",
    }


def _position_line(df: pd.DataFrame, column: str, name: str, color: str, custom: list[str], fmt: str = ".3f") -> dict:
    return {
        "type": "scatter",
        "x": custom,
        "y": df[column],
        "name": name,
        "mode": "lines+markers",
        "line": {"color": color},
        "hovertemplate": "%{x}<br>" + name + ": %{y:" + fmt + "}<extra></extra>",
    }


def _custom(df: pd.DataFrame) -> list[str]:
    return [f"{p} {t}" for p, t in zip(df["position"], df["token"], strict=True)]


def block_updates(df: pd.DataFrame, block: int) -> go.Figure:
    custom = _custom(df)
    traces = [
        _position_bar(df, "attention update", "|attention update|", COLORS["attention"], custom),
        _position_bar(df, "FFN update", "|FFN update|", COLORS["ffn"], custom),
        _position_line(df, "stream", "|x_n| (stream in)", COLORS["stream"], custom),
    ]
    return _figure(
        traces,
        f"Block {block}: update sizes per position",
        barmode="group",
        xaxis=_positions(custom, "position"),
        yaxis={"title": {"text": "L2 norm"}},
    )


def mlp_update(df: pd.DataFrame, block: int) -> go.Figure:
    custom = _custom(df)
    traces = [
        _position_bar(df, "FFN update", "|MLP update|", COLORS["dense"], custom),
        _position_line(df, "stream", "|x_n| (stream in)", COLORS["stream"], custom),
    ]
    return _figure(
        traces,
        f"Block {block}: size of the dense MLP's update per position",
        xaxis=_positions(custom, "position"),
        yaxis={"title": {"text": "L2 norm"}},
    )


def norm_rms(df: pd.DataFrame, block: int) -> go.Figure:
    custom = _custom(df)
    traces = [
        _position_line(df, column, f"RMS of the {column}", color, custom, ".4f")
        for column, color in (("attn_norm input", COLORS["attention"]), ("ffn_norm input", COLORS["ffn"]))
        if column in df
    ]
    return _figure(
        traces,
        f"Block {block}: the stream's RMS at each norm",
        xaxis=_positions(custom, "position"),
        yaxis={"title": {"text": "RMS the norm divides by"}, "type": "log"},
    )


def residual_norms(g: ResidualGrids, labels: list[str]) -> go.Figure:
    heat = {
        "type": "heatmap",
        "z": g.norm,
        "x": labels,
        "y": g.rows,
        "colorscale": SEQUENTIAL,
        "hovertemplate": "%{y}<br>position %{x}<br>|x| = %{z:.3f}<extra></extra>",
        "colorbar": {"title": {"text": "|x|"}},
    }
    return _figure(
        [heat],
        "Residual stream norm |x| per layer and position",
        height=_heat_height(len(g.rows), lo=380, per=34),
        yaxis=_reversed(),
        xaxis=_positions(labels, "position"),
    )


def residual_cosine(g: ResidualGrids, labels: list[str]) -> go.Figure:
    heat = {
        "type": "heatmap",
        "z": g.cos,
        "x": labels,
        "y": g.cos_rows,
        "colorscale": SEQUENTIAL,
        "zmax": 1,
        "hovertemplate": "%{y}: cos(x_out, x_in)<br>position %{x}<br>cos = %{z:.4f}<extra></extra>",
        "colorbar": {"title": {"text": "cos"}},
    }
    return _figure(
        [heat],
        "Cosine between a block's output and its input",
        height=_heat_height(len(g.cos_rows), lo=380, per=34),
        yaxis=_reversed(),
        xaxis=_positions(labels, "position"),
    )


def update_sizes(g: ResidualGrids) -> go.Figure:
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
    return _figure(
        traces,
        "Update sizes per block: mean over positions, whiskers the range",
        barmode="group",
        yaxis={"title": {"text": "L2 norm"}},
    )


def logit_lens(lens: Lens, labels: list[str]) -> go.Figure:
    rows = [f"after block {i}" for i in lens.layers]
    n = len(labels)
    heat = {
        "type": "heatmap",
        "z": lens.prob,
        "x": labels,
        "y": rows,
        "colorscale": SEQUENTIAL,
        "zmin": 0,
        "zmax": 1,
        "customdata": lens.hover,
        "hovertemplate": "%{y} · position %{x}<br><b>top tokens</b><br>%{customdata}<extra></extra>",
        "colorbar": {"title": {"text": "p(top 1)"}},
    }
    if n <= TICK_LIMIT:
        heat.update(text=lens.top1, texttemplate="%{text}", textfont={"size": 10})
    return _figure(
        [heat],
        "Logit lens: the top next token read from each block's output",
        height=_heat_height(len(rows), lo=320, per=48),
        yaxis=_reversed(),
        xaxis=_positions(labels, "position (predicting the next token)"),
    )


def next_token(df: pd.DataFrame) -> go.Figure:
    bar = {
        "type": "bar",
        "x": df["probability"],
        "y": [f"{r + 1}. {t}" for r, t in zip(df["rank"], df["shown"], strict=True)],
        "orientation": "h",
        "marker": {"color": COLORS["attention"]},
        "customdata": np.stack([df["token_id"], df["logit"]], -1),
        "hovertemplate": "%{y}<br>p = %{x:.4f}<br>id %{customdata[0]}, logit %{customdata[1]:.3f}<extra></extra>",
    }
    return _figure(
        [bar],
        "Next token after the last position",
        height=110 + 26 * len(df),
        yaxis=_reversed(),
        xaxis={"title": {"text": "probability"}},
    )


# --- attention ----------------------------------------------------------------------------------------------
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
    return _figure(
        traces,
        title,
        height=_heat_height(len(labels), lo=360, hi=760, per=14),
        yaxis=_reversed(**_positions(labels, "query position")),
        xaxis=_positions(labels, "key position"),
        **layout,
    )


def attention(z: np.ndarray, labels: list[str], title: str) -> go.Figure:
    return _pair_figure([_pair_heatmap(z, labels, ATTN, "p", zmin=0)], labels, title)


def index_scores(z: np.ndarray, marked: np.ndarray, labels: list[str], title: str, marks: str = "selected") -> go.Figure:
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


def sparse_mask(grid: np.ndarray, labels: list[str], title: str) -> go.Figure:
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


def recall(layers: list[int], z: np.ndarray, labels: list[str]) -> go.Figure:
    rows = [f"block {i}" for i in layers]
    heat = {
        "type": "heatmap",
        "z": z,
        "x": labels,
        "y": rows,
        "zmin": 0,
        "zmax": 1,
        "colorscale": SEQUENTIAL,
        "hovertemplate": "%{y} · query %{x}<br>recall %{z:.4f}<extra></extra>",
        "colorbar": {"title": {"text": "recall"}, "x": 1.0, "xanchor": "left"},
    }
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
    return _figure(
        [heat, means],
        "Indexer recall of the dense attention mass per query and block (right: mean over queries)",
        height=_heat_height(len(rows), per=40),
        showlegend=False,
        yaxis=_reversed(),
        xaxis=_positions(labels, "query position", domain=[0, 0.8]),
        xaxis2={"domain": [0.84, 1], "range": [0, 1], "title": {"text": "mean"}},
    )


def query_profile(df: pd.DataFrame, query: int, token: str, block: int) -> go.Figure:
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
    return _figure(
        traces,
        f"Block {block}, query {query} {token}: grey bars are keys the indexer dropped",
        xaxis=_positions(custom, "key position"),
        yaxis={"title": {"text": "attention probability"}, "rangemode": "tozero"},
        yaxis2={"title": {"text": "index score"}, "overlaying": "y", "side": "right", "showgrid": False},
    )


# --- router -------------------------------------------------------------------------------------------------
def router_scores(r: Routing, labels: list[str], per_group: int, biased: bool = False) -> go.Figure:
    z = r.biased if biased and r.biased is not None else r.scores
    name = "s + b" if biased else "s"
    n, e = r.selected.shape
    custom = np.stack([np.repeat((np.arange(e) // per_group)[None, :], n, 0), r.weight, r.rank], -1)
    traces: list[dict] = [
        {
            "type": "heatmap",
            "z": z,
            "y": labels,
            "colorscale": SEQUENTIAL,
            "customdata": custom,
            "hovertemplate": "token %{y}<br>expert %{x} (group %{customdata[0]})<br>"
            + name
            + " = %{z:.4f}<br>weight %{customdata[1]:.4f}, choice rank %{customdata[2]} (-1: not chosen)<extra></extra>",
            "colorbar": {"title": {"text": name}},
        }
    ]
    if r.groups_chosen is not None:  # the groups a token may not use, darkened
        traces.append(
            {
                "type": "heatmap",
                "z": np.where(np.repeat(r.groups_chosen, per_group, axis=1), np.nan, 1.0),
                "y": labels,
                "colorscale": [[0, "rgba(0,0,0,0.45)"], [1, "rgba(0,0,0,0.45)"]],
                "showscale": False,
                "hoverinfo": "skip",
                "name": "groups not chosen",
            }
        )
    q, ex = np.nonzero(r.selected)
    weights = r.weight[q, ex]
    finite = weights[np.isfinite(weights)]  # a trace file may hold NaN or negative weights: plotly refuses such sizes
    biggest = max(float(np.abs(finite).max()) if len(finite) else 1.0, 1e-9)
    traces.append(
        {
            "type": "scatter",
            "x": ex,
            "y": np.asarray(labels, dtype=object)[q],
            "mode": "markers",
            "name": "chosen expert (size: weight)",
            "marker": {
                "symbol": "circle-open",
                "color": COLORS["marker"],
                "size": 5 + 10 * np.nan_to_num(np.clip(weights / biggest, 0, 1), nan=0.0),
                "line": {"width": 2},
            },
            "customdata": weights,
            "hovertemplate": "token %{y}<br>expert %{x}, weight %{customdata:.4f}<extra></extra>",
        }
    )
    return _figure(
        traces,
        f"Block {r.block}: router scores {name} over tokens × experts",
        height=_heat_height(len(labels), lo=360, hi=760, per=14),
        showlegend=True,
        shapes=_vlines([g * per_group - 0.5 for g in range(1, e // per_group)]),
        yaxis=_reversed(**_positions(labels, "token")),
        xaxis={"title": {"text": f"routed expert (white lines: groups of {per_group}; darkened: groups not chosen)"}},
    )


def groups(r: Routing, labels: list[str]) -> go.Figure:
    n, g = r.group_scores.shape
    heat = {
        "type": "heatmap",
        "z": r.group_scores,
        "y": labels,
        "colorscale": SEQUENTIAL,
        "customdata": np.where(r.groups_chosen, "chosen", "not chosen"),
        "hovertemplate": "token %{y}<br>group %{x}: score %{z:.4f}<br>%{customdata}<extra></extra>",
        "colorbar": {"title": {"text": "γ"}},
    }
    q, gg = np.nonzero(r.groups_chosen)
    marks = {
        "type": "scatter",
        "x": gg,
        "y": np.asarray(labels, dtype=object)[q],
        "mode": "markers",
        "name": "chosen group",
        "marker": {"symbol": "square-open", "size": 10, "color": COLORS["marker"], "line": {"width": 2}},
        "hoverinfo": "skip",
    }
    return _figure(
        [heat, marks],
        f"Block {r.block}: group scores γ, chosen groups boxed",
        height=_heat_height(len(labels), lo=360, hi=760, per=14),
        showlegend=True,
        yaxis=_reversed(**_positions(labels, "token")),
        xaxis={"title": {"text": "expert group"}, "dtick": 1},
    )


def expert_weights(df: pd.DataFrame, labels: list[str], block: int, n_experts: int) -> go.Figure:
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
    return _figure(
        traces,
        f"Block {block}: chosen experts and their weights",
        height=420,
        barmode="stack",
        xaxis=_positions(labels, "position"),
        yaxis={"title": {"text": "gating weight, stacked (numbers: expert)"}},
    )


def _palette(n: int) -> list[str]:
    import plotly.colors as pc

    base = pc.qualitative.Dark24 + pc.qualitative.Light24
    return [base[i % len(base)] for i in range(n)]


def routed_shared(df: pd.DataFrame, block: int) -> go.Figure:
    custom = _custom(df)
    traces = [
        _position_bar(df, "routed experts", "|routed experts|", COLORS["moe"], custom),
        _position_bar(df, "shared expert", "|shared expert|", COLORS["dense"], custom),
    ]
    return _figure(
        traces,
        f"Block {block}: routed vs shared expert output size",
        height=320,
        barmode="group",
        xaxis=_positions(custom, "position"),
        yaxis={"title": {"text": "L2 norm of the output"}},
    )


def bias(effect: BiasEffect, per_group: int) -> go.Figure:
    """Two panels on one expert axis: the bias b, and the load with and without it."""
    e = len(effect.bias)
    x = np.arange(e)
    traces = [
        {
            "type": "bar",
            "x": x,
            "y": effect.bias,
            "yaxis": "y2",
            "marker": {"color": COLORS["stream"]},
            "name": "bias b",
            "hovertemplate": "expert %{x}: b = %{y:.5f}<extra></extra>",
        },
        {
            "type": "bar",
            "x": x,
            "y": effect.load_with,
            "name": "tokens with bias (as run)",
            "marker": {"color": COLORS["moe"]},
            "hovertemplate": "expert %{x}: %{y} tokens with bias<extra></extra>",
        },
        {
            "type": "bar",
            "x": x,
            "y": effect.load_without,
            "name": "tokens without bias (b = 0)",
            "marker": {"color": "#9D9D9D"},
            "hovertemplate": "expert %{x}: %{y} tokens without bias<extra></extra>",
        },
    ]
    return _figure(
        traces,
        "The correction bias b (top) and the tokens each expert receives with and without it (bottom)",
        height=480,
        barmode="group",
        shapes=_vlines([g * per_group - 0.5 for g in range(1, e // per_group)], color="#999", width=1, dash="dot"),
        yaxis={"domain": [0, 0.55], "title": {"text": "tokens routed"}},
        yaxis2={"domain": [0.65, 1], "title": {"text": "bias b"}, "anchor": "x"},
        xaxis={"title": {"text": "routed expert (dotted lines: groups)"}},
    )


def expert_load(layers: list[int], counts: np.ndarray, weights: np.ndarray | None, n_tokens: int) -> go.Figure:
    rows = [f"block {i}" for i in layers]
    heat = {
        "type": "heatmap",
        "z": counts,
        "y": rows,
        "colorscale": SEQUENTIAL,
        "zmin": 0,
        "customdata": weights if weights is not None else np.zeros_like(counts, dtype=float),
        "hovertemplate": "%{y} · expert %{x}<br>%{z} of "
        + str(n_tokens)
        + " tokens<br>mean weight %{customdata:.4f}<extra></extra>",
        "colorbar": {"title": {"text": "tokens"}},
    }
    return _figure(
        [heat],
        "Expert load: tokens routed to each expert, per MoE block",
        height=_heat_height(len(rows), per=32),
        yaxis=_reversed(),
        xaxis={"title": {"text": "routed expert"}},
    )


# --- interventions ------------------------------------------------------------------------------------------
BEFORE, AFTER = "#9D9D9D", COLORS["moe"]  # baseline, intervened


def drift(d: Drift, labels: list[str]) -> go.Figure:
    """Relative L2 distance between the baseline's and the intervened stream, per point and position."""
    heat = {
        "type": "heatmap",
        "z": d.rel_l2,
        "x": labels,
        "y": d.rows,
        "colorscale": SEQUENTIAL,
        "zmin": 0,
        "customdata": d.cosine,
        "hovertemplate": "%{y}<br>position %{x}<br>relative L2 %{z:.4g}<br>cosine %{customdata:.5f}<extra></extra>",
        "colorbar": {"title": {"text": "rel. L2"}},
    }
    return _figure(
        [heat],
        "How far the residual stream moved: |x_intervened − x_baseline| / |x_baseline|",
        height=_heat_height(len(d.rows), lo=320, per=26),
        yaxis=_reversed(),
        xaxis=_positions(labels, "position"),
    )


def block_changes(frame: pd.DataFrame, n_tokens: int) -> go.Figure:
    """Per block: positions whose experts, indexer keys or logit-lens top-1 changed (bars), and the
    largest drift of the block's output (line, right axis)."""
    x = [f"block {i}" for i in frame["layer"]]
    traces: list[dict] = []
    for column, name, color in (
        ("experts_changed", "experts", COLORS["moe"]),
        ("keys_changed", "indexer keys", COLORS["attention"]),
        ("top1_changed", "logit-lens top-1", COLORS["ffn"]),
    ):
        if column in frame:
            traces.append(
                {
                    "type": "bar",
                    "x": x,
                    "y": frame[column],
                    "name": name,
                    "marker": {"color": color},
                    "hovertemplate": "%{x}: " + name + " changed at %{y} of " + str(n_tokens) + " positions<extra></extra>",
                }
            )
    if "max_rel_l2" in frame:
        traces.append(
            {
                "type": "scatter",
                "x": x,
                "y": frame["max_rel_l2"],
                "yaxis": "y2",
                "mode": "lines+markers",
                "name": "output drift (max rel. L2)",
                "line": {"color": COLORS["stream"]},
                "hovertemplate": "%{x}: output moved by up to %{y:.4g} (relative L2)<extra></extra>",
            }
        )
    return _figure(
        traces,
        "What changed, block by block: positions with other experts, keys, lens top-1",
        height=400,
        barmode="group",
        xaxis={"title": {"text": "block"}},
        yaxis={"title": {"text": "positions changed"}, "range": [0, max(n_tokens, 1)]},
        yaxis2={
            "title": {"text": "max relative L2"},
            "tickformat": ".2g",
            "overlaying": "y",
            "side": "right",
            "showgrid": False,
            "rangemode": "tozero",
        },
    )


def expert_load_change(before: np.ndarray, after: np.ndarray, ablated: tuple[int, ...], block: int, per_group: int) -> go.Figure:
    """Tokens per expert of one MoE block, baseline and intervened; ablated experts crossed out."""
    x = np.arange(len(before))
    traces: list[dict] = [
        {
            "type": "bar",
            "x": x,
            "y": before,
            "name": "baseline",
            "marker": {"color": BEFORE},
            "hovertemplate": "expert %{x}: %{y} tokens (baseline)<extra></extra>",
        },
        {
            "type": "bar",
            "x": x,
            "y": after,
            "name": "intervened",
            "marker": {"color": AFTER},
            "hovertemplate": "expert %{x}: %{y} tokens (intervened)<extra></extra>",
        },
    ]
    if ablated:
        traces.append(
            {
                "type": "scatter",
                "x": list(ablated),
                "y": [0] * len(ablated),
                "mode": "markers",
                "name": "ablated",
                "marker": {"symbol": "x", "size": 11, "color": COLORS["marker"]},
                "hovertemplate": "expert %{x}: ablated<extra></extra>",
            }
        )
    e = len(before)
    return _figure(
        traces,
        f"Block {block}: tokens per expert, baseline and intervened",
        height=380,
        barmode="group",
        shapes=_vlines([g * per_group - 0.5 for g in range(1, e // per_group)], color="#999", width=1, dash="dot"),
        xaxis={"title": {"text": "routed expert (dotted lines: groups)"}},
        yaxis={"title": {"text": "tokens routed"}},
    )


def lens_changes(lc: LensChange, labels: list[str]) -> go.Figure:
    """Where the logit lens's top-1 token changed (the new token written in the cell)."""
    rows = [f"block {i}" for i in lc.layers]
    heat = {
        "type": "heatmap",
        "z": lc.changed,
        "x": labels,
        "y": rows,
        "zmin": 0,
        "zmax": 1,
        "colorscale": [[0, "#F2F2F2"], [1, COLORS["ffn"]]],
        "showscale": False,
        "customdata": lc.hover,
        "hovertemplate": "%{y} · position %{x}<br>%{customdata}<extra></extra>",
        "xgap": 1,
        "ygap": 1,
    }
    if len(labels) <= TICK_LIMIT:
        heat.update(text=lc.text, texttemplate="%{text}", textfont={"size": 10})
    return _figure(
        [heat],
        "Logit lens: where the top-1 token changed (orange; the cell names the new one, hover: before → after)",
        height=_heat_height(len(rows), lo=260, per=40),
        yaxis=_reversed(),
        xaxis=_positions(labels, "position (predicting the next token)"),
    )


def next_token_change(df: pd.DataFrame) -> go.Figure:
    """The top next tokens of either run, with their probability in both."""
    y = list(df["shown"])
    traces = [
        {
            "type": "bar",
            "x": df[column],
            "y": y,
            "orientation": "h",
            "name": name,
            "marker": {"color": color},
            "customdata": np.stack([df["token_id"], df["delta"]], -1),
            "hovertemplate": "%{y} (id %{customdata[0]})<br>"
            + name
            + ": p = %{x:.4f}<br>change %{customdata[1]:+.4f}<extra></extra>",
        }
        for column, name, color in (("prob_a", "baseline", BEFORE), ("prob_b", "intervened", AFTER))
    ]
    return _figure(
        traces,
        "Next token after the last position, baseline and intervened",
        height=130 + 30 * len(df),
        barmode="group",
        yaxis={**_reversed(), "type": "category"},
        xaxis={"title": {"text": "probability"}},
    )
