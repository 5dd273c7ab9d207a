"""The router: scores over tokens x experts, the chosen groups and experts, and what the correction
bias changed (the same rule re-run without it, model.moe.select_experts)."""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import torch

from app.core.keys import Key
from model.moe import RouterRule, select_experts
from tracing.tables.grid import index_grid
from tracing.trace import Trace

from .arrays import site
from .figures import COLORS, SEQUENTIAL, figure, group_lines, heat_height, positions, reversed_axis
from .tokens import token_texts


def moe_blocks(trace: Trace) -> list[int]:
    return trace.layers_with("ffn.gate.topk_indices")


@dataclass
class Routing:
    block: int
    scores: np.ndarray | None  # [T, E] s
    biased: np.ndarray | None  # [T, E] s + b
    selected: np.ndarray  # [T, E] bool
    weight: np.ndarray  # [T, E] gating weight (0 where not chosen)
    rank: np.ndarray  # [T, E] rank among the chosen, -1 elsewhere
    group_scores: np.ndarray | None  # [T, G]
    groups_chosen: np.ndarray | None  # [T, G] bool


def routing(trace: Trace, block: int) -> Routing | None:
    idx = site(trace, block, "ffn.gate.topk_indices")
    if idx is None:
        return None
    e = trace.config.n_routed_experts
    w = site(trace, block, "ffn.gate.topk_weights")
    groups = site(trace, block, "ffn.gate.groups")
    return Routing(
        block,
        site(trace, block, "ffn.gate.scores"),
        site(trace, block, "ffn.gate.biased_scores"),
        selected=index_grid(idx, e),
        weight=index_grid(idx, e, 0 if w is None else w, 0, np.float64),
        rank=index_grid(idx, e, np.arange(idx.shape[1]), -1, np.int64),
        group_scores=site(trace, block, "ffn.gate.group_scores"),
        groups_chosen=None if groups is None else index_grid(groups, trace.config.n_expert_groups),
    )


@dataclass
class BiasEffect:
    block: int
    bias: np.ndarray  # [E] b, recovered as biased - unbiased scores
    with_bias: np.ndarray  # [T, k] chosen (as recorded)
    without_bias: np.ndarray  # [T, k] chosen by the same rule with b = 0
    reproduced: bool  # recomputing the choice from the recorded biased scores gives the trace's choice
    changed: np.ndarray  # [T] experts that differ per token
    load_with: np.ndarray  # [E]
    load_without: np.ndarray  # [E]


def bias_effect(trace: Trace, block: int) -> BiasEffect | None:
    """What the correction bias changed: the experts the same rule picks from the unbiased scores."""
    r = routing(trace, block)
    if r is None or r.scores is None or r.biased is None:
        return None
    cfg = trace.config
    recorded = site(trace, block, "ffn.gate.topk_indices")
    rule = RouterRule.of(cfg)
    # b = 0 keeps the biased router's group rule (sum of the top two) while adding nothing
    zero = torch.zeros(cfg.n_routed_experts) if cfg.has_gate_bias else None
    again = select_experts(torch.from_numpy(r.biased), zero, rule).topk_indices.numpy()
    without = select_experts(torch.from_numpy(r.scores), zero, rule).topk_indices.numpy()
    changed = np.array([len(set(a) - set(b)) for a, b in zip(recorded.tolist(), without.tolist(), strict=True)])
    e = cfg.n_routed_experts
    return BiasEffect(
        block=block,
        bias=(r.biased - r.scores).mean(axis=0),
        with_bias=recorded,
        without_bias=without,
        reproduced=bool(np.array_equal(np.sort(again, -1), np.sort(recorded, -1))),
        changed=changed,
        load_with=np.bincount(recorded.ravel(), minlength=e),
        load_without=np.bincount(without.ravel(), minlength=e),
    )


def bias_changes(trace: Trace, effect: BiasEffect) -> pd.DataFrame:
    """One row per token whose experts the bias changed."""
    rows = []
    tokens = token_texts(trace)
    for t in np.flatnonzero(effect.changed):
        a, b = set(effect.with_bias[t].tolist()), set(effect.without_bias[t].tolist())
        rows.append(
            {
                "position": int(t),
                "token": html.unescape(tokens[t]),
                "chosen with bias": ", ".join(map(str, sorted(a))),
                "without bias": ", ".join(map(str, sorted(b))),
                "gained by bias": ", ".join(map(str, sorted(a - b))),
                "lost to bias": ", ".join(map(str, sorted(b - a))),
            }
        )
    return pd.DataFrame(rows)


def router_scores_figure(r: Routing, labels: list[str], per_group: int, biased: bool = False) -> go.Figure:
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
    return figure(
        traces,
        f"Block {r.block}: router scores {name} over tokens × experts",
        height=heat_height(len(labels), lo=360, hi=760, per=14),
        showlegend=True,
        shapes=group_lines(e, per_group),
        yaxis=reversed_axis(**positions(labels, "token")),
        xaxis={"title": {"text": f"routed expert (white lines: groups of {per_group}; darkened: groups not chosen)"}},
    )


def groups_figure(r: Routing, labels: list[str]) -> go.Figure:
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
    return figure(
        [heat, marks],
        f"Block {r.block}: group scores γ, chosen groups boxed",
        height=heat_height(len(labels), lo=360, hi=760, per=14),
        showlegend=True,
        yaxis=reversed_axis(**positions(labels, "token")),
        xaxis={"title": {"text": "expert group"}, "dtick": 1},
    )


def bias_figure(effect: BiasEffect, per_group: int) -> go.Figure:
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
    return figure(
        traces,
        "The correction bias b (top) and the tokens each expert receives with and without it (bottom)",
        height=480,
        barmode="group",
        shapes=group_lines(e, per_group, color="#999", width=1, dash="dot"),
        yaxis={"domain": [0, 0.55], "title": {"text": "tokens routed"}},
        yaxis2={"domain": [0.65, 1], "title": {"text": "bias b"}, "anchor": "x"},
        xaxis={"title": {"text": "routed expert (dotted lines: groups)"}},
    )


# --- margins ---------------------------------------------------------------------------------------------------
def margins(table: pd.DataFrame, block: int) -> pd.DataFrame | None:
    """The block's routing margin per position (tracing.tables.frames.margins_table), or None."""
    if table.empty or block not in set(table["block"]):
        return None
    return table[table["block"] == block].reset_index(drop=True)


def margins_figure(frame: pd.DataFrame, labels: list[str], block: int, near: float) -> go.Figure:
    """Bars of each position's margin, near-ties (below ``near``) also marked ▲ in the marker colour: where
    a small change of the scores (a rounding, the bias) would change the chosen set. A near-tie's bar is
    too short to see on the scale of the others, hence the mark."""
    trace = {
        "type": "bar",
        "x": labels,
        "y": frame["margin"],
        "marker": {"color": COLORS["norm"]},
        "hovertemplate": "%{x}<br>margin %{y:.5f}<extra></extra>",
        "name": "margin",
    }
    traces = [trace]
    tied = frame["near_tie"].to_numpy(dtype=bool)  # (T,)
    ties = int(tied.sum())
    title = f"Block {block}: routing margin per position ({ties} near-tie{'s' if ties != 1 else ''} below {near:g}, red ▲)"
    if "group_margin" in frame and frame["group_margin"].notna().any():  # the group step's margin beside the experts'
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "x": labels,
                "y": frame["group_margin"],
                "marker": {"symbol": "diamond", "size": 9, "color": COLORS["attention"], "line": {"width": 1}},
                "hovertemplate": "%{x}<br>group margin %{y:.5f}<extra></extra>",
                "name": "group margin",
            }
        )
        group_ties = int(frame["near_tie_group"].sum())
        title += f"; groups (diamonds): {group_ties} near-tie{'s' if group_ties != 1 else ''}"
    if ties:  # drawn last: over the diamonds
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "x": [label for label, tie in zip(labels, tied, strict=True) if tie],
                "y": frame["margin"][tied],
                "marker": {"symbol": "triangle-up", "size": 10, "color": COLORS["marker"]},
                "cliponaxis": False,  # at y ~ 0: whole, not cut by the axis
                "hovertemplate": "%{x}<br>near-tie: margin %{y:.5f}<extra></extra>",
                "name": "near-tie",
            }
        )
    yaxis = {"title": {"text": "last chosen - best unchosen"}}
    return figure(traces, title, xaxis=positions(labels, "position"), yaxis=yaxis)


# --- where an atlas's expert fires in this prompt -----------------------------------------------------------
def marked_tokens(tokens: list[str], marked: np.ndarray, weight: np.ndarray) -> str:
    """The prompt with the tokens routed to one expert on a coloured background (hover: position and
    gate weight), the others in grey. HTML, every token escaped."""
    parts = []
    for i, (token, on) in enumerate(zip(tokens, marked, strict=True)):
        text = html.escape(token).replace("\n", "⏎<br>") or "∅"
        if on:
            parts.append(
                f'<span class="routed-token" data-position="{i}" title="position {i} · gate weight {weight[i]:.3f}" '
                f'style="background:{COLORS["moe"]}55;color:inherit;border-radius:3px;padding:0 1px">{text}</span>'
            )
        else:
            parts.append(f'<span data-position="{i}" title="position {i}" style="color:#888">{text}</span>')
    return f'<div style="white-space:pre-wrap;line-height:1.9;font-size:1.05rem">{"".join(parts)}</div>'


# the Router page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("router_biased", "Router: scores with the correction bias", kept=True),
    Key("router_atlas_expert_", "Router: the atlas expert whose tokens in the prompt are marked (per block)", family=True),
    Key("router_skip_first", "Router: the routed and shared outputs with position 0 left out", kept=True),
)
