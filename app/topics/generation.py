"""Generation: the text as the model wrote it, each new token coloured by the probability it was
chosen with, and for each written token the pass that chose it (the pass at the position before:
its alternatives, the experts it used in every MoE block, the keys the indexer kept, the logit
lens); then, across the steps, the experts of one block and how far back the indexer reaches."""

from __future__ import annotations

import html

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import Key
from tracing.tables.grid import index_grid
from tracing.trace import Trace

from .arrays import site
from .attention import index_scores
from .figures import COLORS, figure, heatmap, position_figure, positions, reversed_axis, rows_figure
from .predictions import Lens
from .router import moe_blocks
from .tokens import show_token


def generation(trace: Trace) -> dict | None:
    """The trace's ``generation`` record when it wrote at least one token, else None."""
    info = trace.extra.get("generation") or {}
    return info if info.get("generated", 0) > 0 else None


def written(trace: Trace) -> list[int]:
    """The positions of the generated tokens: each was chosen by the pass at the position before."""
    info = generation(trace)
    return [] if info is None else list(range(int(info["start"]), trace.n_tokens))


def step_label(trace: Trace, position: int) -> str:
    return f"{position} {show_token(trace.tokens[position], limit=14, html_escape=False)}"


# --- the text -------------------------------------------------------------------------------------------------
def probability_colour(p: float) -> str:
    """Red (unlikely) through yellow to green (certain), light enough to read black text on."""
    hue = 120 * min(max(p, 0.0), 1.0) if np.isfinite(p) else 0
    return f"hsl({hue:.0f}, 75%, 78%)"


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token sequences differ (one ending early counts), or None: the same."""
    for position, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return position
    return None if len(a) == len(b) else min(len(a), len(b))


def coloured_text(steps: pd.DataFrame, start: int, mark: int | None = None) -> str:
    """The prompt in grey, then each generated token on a background coloured by its probability
    (hover: position, probability, the most likely alternative); ``mark``: a position to outline.
    HTML, every token escaped."""
    parts = []
    for row in steps.itertuples(index=False):
        text = html.escape(str(row.token)).replace("\n", "⏎<br>")
        if row.position < start:
            parts.append(f'<span style="color:#888">{text}</span>')
            continue
        outline = ";outline:2px solid #d00" if row.position == mark else ""
        tip = html.escape(
            f"position {row.position} · p = {row.chosen_prob:.3f} · most likely: {row.alt1!r} ({row.alt1_prob:.3f})"
        )
        parts.append(
            f'<span class="generated-token" title="{tip}" style="background:{probability_colour(row.chosen_prob)};'
            f'color:#111;border-radius:3px;padding:0 1px{outline}">{text}</span>'
        )
    return f'<div style="white-space:pre-wrap;line-height:1.9;font-size:1.05rem">{"".join(parts)}</div>'


def probability_figure(steps: pd.DataFrame, start: int | None) -> go.Figure:
    """Per position: the probability the distribution before it gave its token (the entropy is in the table)."""
    frame = steps.assign(token=[show_token(t, limit=14) for t in steps["token"]])
    series = [("bar", "chosen_prob", "p(token)", COLORS["attention"])]
    title = "How likely each token was, given the text before it" + ("" if start is None else " (generated from the line)")
    layout: dict = {"height": 320}
    if start is not None:
        x = f"{start} {frame['token'].iloc[start]}"
        layout["shapes"] = [
            {"type": "line", "x0": x, "x1": x, "y0": 0, "y1": 1, "yref": "paper", "xref": "x", "line": {"dash": "dot"}}
        ]
    return position_figure(frame, series, title, {"title": {"text": "probability"}, "range": [0, 1]}, **layout)


# --- the MTP module's drafts ----------------------------------------------------------------------------------
def mtp_drafts(steps: pd.DataFrame, start: int) -> pd.DataFrame | None:
    """Per generated token: the MTP module's draft of it (made the step before, from the token then
    chosen), its probability, and whether the model then wrote it. None when the trace has no drafts."""
    if "mtp_draft" not in steps:
        return None
    rows = steps[steps["position"] >= start]
    return pd.DataFrame(
        {
            "position": rows["position"],
            "written": [show_token(t, html_escape=False) for t in rows["token"]],
            "draft": [show_token(t, html_escape=False) for t in rows["mtp_draft"]],
            "draft_prob": rows["mtp_draft_prob"],
            "accepted": rows["mtp_accepted"],
            "verified": rows["mtp_verified"],  # drafted from a generated token: what a speculative decoder checks
        }
    )


def mtp_summary(info: dict) -> str | None:
    """One line on the drafts' acceptance (the generation record's mtp_acceptance), or None."""
    got = info.get("mtp_acceptance")
    if not got:
        return None
    if not got["drafts"]:
        return "No draft to check: the MTP module's drafts are checked from the second generated token on."
    return (
        f"The MTP module's draft equalled the token the model then wrote {got['accepted']} of {got['drafts']} times "
        f"({got['rate']:.0%}): a speculative decoder with this draft would write about {1 + got['rate']:.2f} tokens per pass."
    )


def mtp_figure(drafts: pd.DataFrame) -> go.Figure:
    """Per generated token: the draft's probability, coloured by whether the model wrote it; the first
    token's draft (made in the prefill, which no speculative decoder checks) in grey, as the rate leaves
    it out."""
    accepted = drafts["accepted"].fillna(False).astype(bool)
    colours = [
        (COLORS["attention"] if a else COLORS["marker"]) if v else COLORS["norm"]
        for a, v in zip(accepted, drafts["verified"], strict=True)
    ]
    bar = {
        "type": "bar",
        "x": [f"{p} {t}" for p, t in zip(drafts["position"], drafts["written"], strict=True)],
        "y": drafts["draft_prob"],
        "marker": {"color": colours},
        "customdata": [html.escape(t, quote=False) for t in drafts["draft"]],  # plotly draws hover text as HTML
        "hovertemplate": "%{x}<br>draft %{customdata}: p = %{y:.3f}<extra></extra>",
    }
    title = (
        "The MTP draft of each written token, made one step before (blue: the model wrote it; red: it did not; "
        "grey: drafted in the prefill, not counted)"
    )
    return figure([bar], title, height=320, yaxis={"title": {"text": "draft probability"}, "range": [0, 1]})


# --- one step -----------------------------------------------------------------------------------------------
def alternatives(steps: pd.DataFrame, position: int) -> pd.DataFrame:
    """The ten most likely tokens of the distribution that chose ``position``'s token, the chosen one marked."""
    row = steps.iloc[position]
    ranks = [r for r in range(1, 11) if f"alt{r}" in steps and row[f"alt{r}"] != ""]
    return pd.DataFrame(
        {
            "rank": ranks,
            "token": [show_token(row[f"alt{r}"], html_escape=False) for r in ranks],
            "probability": [float(row[f"alt{r}_prob"]) for r in ranks],
            "chosen": [row[f"alt{r}"] == row["token"] for r in ranks],
        }
    )


def alternatives_figure(alts: pd.DataFrame, position: int) -> go.Figure:
    colours = [COLORS["marker"] if chosen else COLORS["attention"] for chosen in alts["chosen"]]
    bar = {
        "type": "bar",
        "x": alts["probability"],
        "y": [f"{r}. {html.escape(t)}" for r, t in zip(alts["rank"], alts["token"], strict=True)],
        "orientation": "h",
        "marker": {"color": colours},
        "hovertemplate": "%{y}<br>p = %{x:.4f}<extra></extra>",
    }
    title = f"Position {position}: the ten most likely tokens (red: the one written)"
    return figure([bar], title, height=110 + 26 * len(alts), yaxis=reversed_axis(), xaxis={"title": {"text": "probability"}})


def experts_at(trace: Trace, query: int) -> tuple[list[int], np.ndarray] | None:
    """The MoE blocks and, per block, each expert's gating weight at position ``query`` (NaN: not chosen)."""
    blocks = moe_blocks(trace)
    if not blocks:
        return None
    e = trace.config.n_routed_experts
    rows = []
    for block in blocks:
        idx = site(trace, block, "ffn.gate.topk_indices")[query : query + 1]
        w = site(trace, block, "ffn.gate.topk_weights")
        rows.append(index_grid(idx, e, 1.0 if w is None else w[query : query + 1], np.nan, np.float64)[0])
    return blocks, np.stack(rows)


def experts_at_figure(blocks: list[int], grid: np.ndarray, query: int) -> go.Figure:
    rows = [f"block {b}" for b in blocks]
    heat = heatmap(grid, rows, "%{y} · expert %{x}<br>weight %{z:.4f}", scale="weight", zmin=0)
    title = f"Experts chosen at position {query}, in every MoE block"
    return rows_figure([heat], rows, title, {"title": {"text": "routed expert"}, "dtick": 1}, lo=220, per=32)


def indexer_row(trace: Trace, block: int, query: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The index scores of position ``query`` over the keys before it (NaN where masked) and which it kept."""
    got = index_scores(trace, block)
    if got is None:
        return None
    z, chosen = got
    return z[query, : query + 1], chosen[query, : query + 1]


def indexer_row_figure(scores: np.ndarray, kept: np.ndarray, labels: list[str], block: int, query: int) -> go.Figure:
    keys = labels[: len(scores)]
    colours = np.where(kept, COLORS["attention"], COLORS["norm"]).tolist()
    bar = {
        "type": "bar",
        "x": keys,
        "y": np.nan_to_num(scores, nan=0.0),
        "marker": {"color": colours},
        "customdata": np.where(kept, "kept", "dropped"),
        "hovertemplate": "key %{x}<br>I = %{y:.4f} · %{customdata}<extra></extra>",
    }
    title = f"Block {block}: indexer scores over the cache at position {query} (blue: {int(kept.sum())} kept)"
    return figure([bar], title, height=300, xaxis=positions(keys, "cached key"), yaxis={"title": {"text": "index score I"}})


def lens_at_figure(lens: Lens, query: int, chosen: str) -> go.Figure:
    """Per block: the top token the head reads from the stream at ``query``, and its probability."""
    rows = [f"after block {i}" for i in lens.layers]
    bar = {
        "type": "bar",
        "x": lens.prob[:, query],
        "y": rows,
        "orientation": "h",
        "text": lens.top1[:, query],
        "textposition": "auto",
        "marker": {"color": COLORS["stream"]},
        "customdata": lens.hover[:, query],
        "hovertemplate": "%{y}<br>%{customdata}<extra></extra>",
    }
    title = f"Logit lens at position {query} (written: {html.escape(chosen)})"
    return figure(
        [bar], title, height=140 + 30 * len(rows), yaxis=reversed_axis(), xaxis={"title": {"text": "p(top 1)"}, "range": [0, 1]}
    )


# --- across the steps ---------------------------------------------------------------------------------------------
def expert_timeline(trace: Trace, block: int, steps: list[int]) -> np.ndarray | None:
    """[steps, E]: the gating weight of each expert in the pass that wrote each step's token (NaN: not chosen)."""
    idx = site(trace, block, "ffn.gate.topk_indices")
    if idx is None or not steps:
        return None
    queries = np.asarray(steps) - 1
    w = site(trace, block, "ffn.gate.topk_weights")
    return index_grid(idx[queries], trace.config.n_routed_experts, 1.0 if w is None else w[queries], np.nan, np.float64)


def expert_timeline_figure(grid: np.ndarray, rows: list[str], block: int) -> go.Figure:
    heat = heatmap(grid, rows, "writing %{y} · expert %{x}<br>weight %{z:.4f}", scale="weight", zmin=0)
    title = f"Block {block}: the experts of each step, as the text grows (rows: the token written)"
    return rows_figure([heat], rows, title, {"title": {"text": "routed expert"}, "dtick": 1}, per=20)


def key_distance(trace: Trace, block: int, steps: list[int]) -> pd.DataFrame | None:
    """Per step: how far back the indexer's kept keys reach from the pass that wrote the token
    (query position minus key position: mean and max), and how many keys it kept."""
    topk = site(trace, block, "attn.indexer.topk_indices")
    if topk is None or not steps:
        return None
    rows = []
    for step in steps:
        query = step - 1
        keys = topk[query][topk[query] >= 0]
        distance = query - keys
        rows.append((step, show_token(trace.tokens[step], limit=14), distance.mean(), distance.max(), len(keys)))
    return pd.DataFrame(rows, columns=["position", "token", "mean_distance", "max_distance", "kept"])


def key_distance_figure(frame: pd.DataFrame, block: int) -> go.Figure:
    series = [
        ("line", "mean_distance", "mean distance", COLORS["attention"], ".1f"),
        ("line", "max_distance", "max distance", COLORS["moe"], ".0f"),
    ]
    title = f"Block {block}: how far back the indexer's picks reach at each step (positions)"
    return position_figure(frame, series, title, {"title": {"text": "query − key"}, "rangemode": "tozero"}, height=320)


# the Generation page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("gen_step", "Generation: the step shown", kept=True),
    Key("generation_steps_table", "Generation: every step as a table (the expander)"),
)
