"""Activation patching (tracing.analyses.patching) as heat maps: for each site, blocks x positions
of ``value`` (1: the clean answer restored, 0: nothing changed); a site with heads or experts shows,
per block and position, the one whose patch restored most (its value, the head or expert in the
hover), as TransformerLens' patching plots do."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core.keys import LONGEST, Key, text
from app.core.markup import escape_md

from .figures import DIVERGING, figure, heat_height, heatmap, positions

TITLES = {
    "resid_pre": "the stream entering the block",
    "attn_out": "the attention update",
    "ffn_out": "the FFN update",
    "heads": "one head's output (the best head per cell)",
    "experts": "one routed expert's output (the best expert per cell)",
}


def grid(table: pd.DataFrame, site: str, n_positions: int) -> tuple[np.ndarray, np.ndarray, list[int]] | None:
    """(blocks x positions of the value, of the head or expert it came from (-1: none), the blocks), or None
    when the table has no row of the site. Cells not patched are NaN."""
    rows = table[table["site"] == site]
    if rows.empty:
        return None
    best = rows.loc[rows.groupby(["block", "position"])["value"].idxmax()]
    blocks = sorted(best["block"].unique().tolist())
    z = np.full((len(blocks), n_positions), np.nan)
    index = np.full((len(blocks), n_positions), -1)
    where = {b: i for i, b in enumerate(blocks)}
    for row in best.itertuples():
        z[where[row.block], row.position] = row.value
        index[where[row.block], row.position] = row.index
    return z, index, blocks


def patching_figure(z: np.ndarray, index: np.ndarray, blocks: list[int], labels: list[str], site: str) -> go.Figure:
    """One site's blocks x positions; a symmetric diverging scale covering the data (a patch may overshoot
    1 or push the wrong way)."""
    finite = z[np.isfinite(z)]
    limit = max(1.0, float(np.abs(finite).max())) if finite.size else 1.0
    rows = [f"block {b}" for b in blocks]
    which = "head" if site == "heads" else "expert" if site == "experts" else ""
    hover = "%{y}, %{x}: restored %{z:.3f}" + (f" ({which} %{{customdata}})" if which else "")
    trace = heatmap(z, rows, hover, x=labels, scale="restored", colorscale=DIVERGING, zmin=-limit, zmax=limit, customdata=index)
    title = f"Patching {TITLES.get(site, site)}: share of the clean logit difference restored"
    return figure(
        [trace],
        title,
        height=heat_height(len(rows), lo=220),
        xaxis=positions(labels, "position"),
        yaxis={"autorange": "reversed", "type": "category"},
    )


def position_labels(summary: dict) -> list[str]:
    """A sweep's position labels: the token, or clean → corrupt where the prompts differ."""
    a, b = summary["clean"]["tokens"], summary["corrupt"]["tokens"]
    return [f"{p} {x!r}" if x == y else f"{p} {x!r}→{y!r}" for p, (x, y) in enumerate(zip(a, b, strict=True))]


def map_figure(table: pd.DataFrame, site: str, summary: dict) -> go.Figure | None:
    """A sweep's heat map of one site (tracing.analyses.patching.sweep's table and summary), or None when
    the table has no row of it."""
    got = grid(table, site, summary["tokens"])
    return None if got is None else patching_figure(*got, position_labels(summary), site)


def mean_grid(table: pd.DataFrame, tokens: int | None) -> tuple[pd.DataFrame, int, list[str]]:
    """A pairs file's means (tracing.analyses.prompt_sets) as :func:`grid` reads a sweep: ``value`` the
    mean, at the absolute position where every pair has one length (``tokens``), else counted from
    the end (labels -3, -2, -1); returns (the frame, the positions, their labels)."""
    frame = table.rename(columns={"mean": "value"})
    if tokens is not None:
        return frame, tokens, [str(p) for p in range(tokens)]
    width = int(-table["from_end"].min()) if len(table) else 0
    return frame.assign(position=frame["from_end"] + width), width, [str(p - width) for p in range(width)]


# the Patching page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("patch_clean", "Patching: the clean prompt", kept=True, link=text(LONGEST)),
    Key("patch_corrupt", "Patching: the corrupt prompt", kept=True, link=text(LONGEST)),
    Key("patch_sites", "Patching: the sites swept", kept=True),
    Key("patch_positions", "Patching: the positions swept (all, last, A:B)", kept=True),
    Key("patch_target", "Patching: the target token (text or id; empty: the clean top)", kept=True),
    Key("patch_contrast", "Patching: the contrast token (text or id; empty: the corrupt top)", kept=True),
    Key("patch_method", "Patching: exact (one forward per cell) or gradient (every cell from one backward)", kept=True),
    Key("patch_run", "Patching: the Run button"),
    Key("patch_result", "Patching: the last sweep, {asked, table, summary}"),
    Key("patch_csv", "Patching: the table's CSV download"),
    Key("patch_cell", "Patching: the cell whose patched run is compared with the corrupt run"),
    Key("patch_fig_", "Patching: a site's heat map (the site)", family=True),
    Key("patch_pairs_file", "Patching: the uploaded file of pairs"),
    Key("patch_pairs_run", "Patching: the button that sweeps every pair of the file"),
    Key("patch_pairs_result", "Patching: the last file's sweeps, {asked, table, each, summary}"),
    Key("patch_pairs_csv", "Patching: the means' CSV download"),
    Key("patch_pairs_each_csv", "Patching: every pair's rows, CSV download"),
    Key("patch_pairs_fig_", "Patching: a site's heat map of the means over the pairs (the site)", family=True),
)


def pair_header(model: str, clean: str, corrupt: str, tokens: int | None = None) -> str:
    """The Patching page's line under its title: the pair it sweeps (not the sidebar's trace, another
    prompt) on which model, and the pair's length once a sweep of it ran."""

    def quoted(prompt: str) -> str:
        return f"“{escape_md(prompt if len(prompt) <= 70 else prompt[:69] + '…')}”"

    length = "" if tokens is None else f":gray-badge[:material/notes: {tokens} tokens] "
    return f"{length}:gray-badge[:material/memory: {escape_md(model)}]  clean {quoted(clean)} → corrupt {quoted(corrupt)}"
