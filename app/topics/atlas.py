"""The atlas: what a corpus run (``python -m tracing atlas``) counted, drawn. Every figure reads the
atlas tables (docs/atlas.md) as they are: nothing is recomputed from traces here."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from tempfile import TemporaryDirectory

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from app.core import paths
from app.core.keys import Key
from tracing.atlas import Atlas, AtlasError, read_atlas
from tracing.atlas.tables import experts_table, find_token, search_experts, token_routes

from .figures import COLORS, DIVERGING, figure, heat_height, heatmap, reversed_axis, right_axis
from .tokens import show_token

BUNDLED = Path(__file__).resolve().parents[2] / "assets" / "demo_atlas"


def stamp(path: str) -> tuple:
    """The atlas files' names, sizes and times: what tells a rewritten atlas directory from the one read."""
    folder = Path(path)
    files = sorted(folder.glob("*.parquet")) + [folder / "summary.json"]
    return tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file())


ZIP_NAMES = ("summary.json",)  # besides the tables' <name>.parquet files


def open_zip(data: bytes, name: str, limit: int) -> Atlas:
    """An atlas folder zipped (its files at the top or in one folder), read as data only. The
    members are written under their base names in a fresh directory: no member path reaches
    outside it, and nothing larger than ``limit`` bytes unpacked is read. Errors name the archive, never
    the directory it was unpacked in."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        members = [m for m in archive.infolist() if not m.is_dir()]
    except (zipfile.BadZipFile, ValueError) as exc:
        raise AtlasError(f"{name}: not a zip archive ({exc})") from None
    wanted = [m for m in members if _member_name(m.filename) is not None]
    if not wanted:
        raise AtlasError(f"{name}: no summary.json or .parquet files in the archive: zip an atlas directory")
    if sum(m.file_size for m in wanted) > limit:
        raise AtlasError(f"{name}: unpacks to more than the {limit / 2**20:.3g} MiB this app reads")
    with TemporaryDirectory(prefix="atlas-") as tmp:
        for member in wanted:
            target = Path(tmp) / _member_name(member.filename)
            try:
                target.write_bytes(archive.read(member))
            except (zipfile.BadZipFile, OSError, RuntimeError, ValueError) as exc:
                raise AtlasError(paths.scrubbed(f"{name}: {member.filename} cannot be unpacked ({exc})", tmp, name)) from None
        try:
            return read_atlas(tmp)
        except (AtlasError, OSError) as exc:
            raise AtlasError(paths.scrubbed(str(exc), tmp, name)) from None


def _member_name(path: str) -> str | None:
    base = path.replace("\\", "/").rsplit("/", 1)[-1]
    if base in ZIP_NAMES or (base.endswith(".parquet") and base[:-8].isidentifier()):
        return base
    return None


def blocks(atlas: Atlas) -> list[int]:
    """The MoE blocks the atlas counted."""
    return sorted(int(b) for b in atlas.tables["expert_load"]["block"].unique())


# --- expert load ---------------------------------------------------------------------------------------------
def load_figure(atlas: Atlas, sort: bool) -> go.Figure:
    """Block x expert share of the block's selections; ``sort``: each block's experts from the busiest
    down, so the shape of the imbalance compares across blocks."""
    load = atlas.tables["expert_load"]
    grid = load.pivot(index="block", columns="expert", values="share").fillna(0.0).sort_index()
    counts = load.pivot(index="block", columns="expert", values="count").reindex_like(grid).fillna(0)
    z, experts = grid.to_numpy(), np.broadcast_to(grid.columns.to_numpy(), grid.shape)
    if sort:
        order = np.argsort(-z, axis=1, kind="stable")
        z = np.take_along_axis(z, order, axis=1)
        experts = np.take_along_axis(experts, order, axis=1)
        counts = pd.DataFrame(np.take_along_axis(counts.to_numpy(), order, axis=1), index=grid.index)
    rows = [f"block {b}" for b in grid.index]
    custom = np.stack([experts, counts.to_numpy()], axis=-1)
    x_title = "experts, busiest first" if sort else "expert"
    uniform = 1.0 / max(1, grid.shape[1])
    trace = heatmap(
        z * 100,
        rows,
        "%{y} expert %{customdata[0]}<br>%{z:.2f}% of the selections (%{customdata[1]:,} tokens)",
        customdata=custom,
        scale="% of selections",
        zmin=0,
        zmax=max(float(z.max()) * 100, 2 * uniform * 100),
    )
    title = f"Expert load: each block's share of selections (uniform: {uniform * 100:.2f}% each)"
    return figure([trace], title, height=heat_height(len(rows), per=22), yaxis=reversed_axis(), xaxis={"title": x_title})


def imbalance(atlas: Atlas) -> pd.DataFrame:
    """Per block: max/mean load, coefficient of variation, experts never chosen (from the summary)."""
    rows = atlas.summary.get("imbalance", {})
    frame = pd.DataFrame([{"block": int(b), **v} for b, v in rows.items()])
    return frame.sort_values("block", ignore_index=True) if not frame.empty else frame


def imbalance_figure(table: pd.DataFrame) -> go.Figure:
    x = [f"block {b}" for b in table["block"]]
    traces = [
        {"type": "bar", "x": x, "y": table["max_over_mean"], "name": "busiest / mean", "marker": {"color": COLORS["moe"]}},
        {
            "type": "scatter",
            "mode": "lines+markers",
            "x": x,
            "y": table["cv"],
            "name": "coefficient of variation",
            "yaxis": "y2",
            "marker": {"color": COLORS["attention"]},
        },
    ]
    return figure(
        traces,
        "Imbalance per block (1 = perfectly even)",
        height=300,
        yaxis={"title": {"text": "busiest expert / mean"}, "rangemode": "tozero"},
        yaxis2=right_axis("CV", tickformat=".2f"),
    )


def group_figure(atlas: Atlas) -> go.Figure | None:
    groups = atlas.tables["group_load"]
    if groups.empty or groups["group"].nunique() < 2:
        return None
    grid = groups.pivot(index="block", columns="group", values="count").fillna(0).sort_index()
    share = grid.div(grid.sum(axis=1).where(lambda s: s > 0, 1), axis=0) * 100
    rows = [f"block {b}" for b in grid.index]
    trace = heatmap(
        share.to_numpy(),
        rows,
        "%{y} group %{x}<br>%{z:.1f}% of the group choices",
        x=list(grid.columns),
        scale="% of choices",
    )
    return figure(
        [trace],
        "Group load: how often each expert group was among the groups kept",
        height=heat_height(len(rows), per=22),
        yaxis=reversed_axis(),
        xaxis={"title": "group", "dtick": 1},
    )


# --- co-activation and one expert ----------------------------------------------------------------------------
def pair_matrix(atlas: Atlas, block: int) -> np.ndarray:
    """Symmetric expert x expert counts of tokens that chose both (diagonal: the expert's own count)."""
    n = int(atlas.summary.get("n_routed_experts") or atlas.tables["expert_load"]["expert"].max() + 1)
    matrix = np.zeros((n, n), dtype=np.int64)
    pairs = atlas.tables["expert_pairs"]
    pairs = pairs[pairs["block"] == block]
    a, b, c = (pairs[k].to_numpy(dtype=np.int64) for k in ("expert_a", "expert_b", "count"))
    matrix[a, b] = c
    matrix[b, a] = c
    load = atlas.tables["expert_load"]
    load = load[load["block"] == block]
    matrix[load["expert"].to_numpy(dtype=np.int64), load["expert"].to_numpy(dtype=np.int64)] = load["count"].to_numpy()
    return matrix


def lift(matrix: np.ndarray, tokens: int) -> np.ndarray:
    """Observed pair count over the count two independent experts with these loads would share,
    both plus one, so that a pair never seen together reads as a finite (low) lift."""
    own = np.diag(matrix).astype(float)
    ratio = (matrix + 1.0) / (np.outer(own, own) / max(tokens, 1) + 1.0)
    np.fill_diagonal(ratio, np.nan)
    return ratio


def coactivation_figure(matrix: np.ndarray, tokens: int, block: int, as_lift: bool) -> go.Figure:
    n = matrix.shape[0]
    if as_lift:
        z = np.log2(lift(matrix, tokens))
        trace = heatmap(
            z,
            list(range(n)),
            "experts %{y} and %{x}<br>log2 lift %{z:.2f} (counts plus one)",
            x=list(range(n)),
            colorscale=DIVERGING,
            zmid=0,
            scale="log2 lift",
        )
        title = f"Block {block}: which experts fire together (log2 of observed / independent)"
    else:
        z = matrix.astype(float)
        np.fill_diagonal(z, np.nan)
        trace = heatmap(z, list(range(n)), "experts %{y} and %{x}<br>%{z:,} tokens chose both", x=list(range(n)), scale="tokens")
        title = f"Block {block}: tokens that chose both experts"
    axis = {"title": "expert", "constrain": "domain"}
    return figure(
        [trace], title, height=min(720, max(360, 10 * n + 120)), xaxis=axis, yaxis=reversed_axis(title="expert", scaleanchor="x")
    )


def expert_card(atlas: Atlas, block: int, expert: int, matrix: np.ndarray) -> dict:
    """One expert in one block: load, its most specific tokens, its most frequent partners."""
    load = atlas.tables["expert_load"]
    row = load[(load["block"] == block) & (load["expert"] == expert)]
    tokens = atlas.tables["expert_tokens"]
    tokens = tokens[(tokens["block"] == block) & (tokens["expert"] == expert)].sort_values("specificity", ascending=False)
    partners = pd.DataFrame({"expert": np.arange(matrix.shape[0]), "tokens_together": matrix[expert]})
    partners = partners[partners["expert"] != expert].sort_values("tokens_together", ascending=False).head(8)
    own = int(row["count"].iloc[0]) if not row.empty else 0
    partners["share_of_its_tokens"] = partners["tokens_together"] / max(own, 1)
    return {
        "count": own,
        "share": float(row["share"].iloc[0]) if not row.empty else 0.0,
        "mean_weight": float(row["weight_sum"].iloc[0]) / own if own else 0.0,
        "tokens": tokens.assign(token=tokens["token"].map(lambda t: show_token(t, html_escape=False)))[
            ["token", "token_id", "count", "specificity", "pmi"]
        ],
        "partners": partners.reset_index(drop=True),
    }


# --- every expert, and one token --------------------------------------------------------------------------------
def experts(atlas: Atlas, search: str = "") -> pd.DataFrame:
    """Every block's experts in one table (tracing.atlas.tables.experts_table), the rows ``search``
    names, their most specific tokens as one text cell (whitespace made visible)."""
    frame = search_experts(experts_table(atlas.tables), search)
    shown = frame["top_tokens"].map(lambda tokens: "  ".join(show_token(t, html_escape=False) for t in tokens))
    return frame.drop(columns=["top_tokens", "top_token_ids"]).assign(most_specific_tokens=shown).reset_index(drop=True)


def token_search(atlas: Atlas, text: str) -> tuple[int | None, str | None, pd.DataFrame | None, str]:
    """The token ``text`` names (its text as tokenised, or its id): its id, its text as a figure shows
    it (show_token), per block the experts that took it, and a line that says what was found or why
    nothing was."""
    if "token_experts" not in atlas.tables:
        return None, None, None, "This atlas has no token_experts table (an earlier version): `--resume` on its run writes it."
    token = find_token(atlas.tables, text)
    if token is None:
        spaced = "" if text.startswith(" ") or find_token(atlas.tables, " " + text) is None else f"; {' ' + text!r} is"
        min_count = atlas.summary.get("settings", {}).get("min_count", "--min-count")
        typed = repr(text) if len(text) <= 60 else f"{text[:60]!r}… ({len(text):,} characters)"  # echoed, not pasted back whole
        return (
            None,
            None,
            None,
            f"{typed} is not in the atlas: no token of that text or id seen at least {min_count} times{spaced}",
        )
    routes = token_routes(atlas.tables, token)
    occurrences = int(routes["occurrences"].iloc[0])
    written = str(routes["token"].iloc[0])
    line = f"{show_token(written, html_escape=False)} (id {token}): seen {occurrences:,} times"
    return token, show_token(written), routes.drop(columns=["token_id", "token", "occurrences"]), line


def token_figure(routes: pd.DataFrame, label: str, n_experts: int) -> go.Figure:
    """Block x expert: the share of the token's routings each expert took (blank: not among its experts)."""
    grid = routes.pivot(index="block", columns="expert", values="share").reindex(columns=range(n_experts)).sort_index()
    counts = routes.pivot(index="block", columns="expert", values="count").reindex_like(grid)
    rows = [f"block {b}" for b in grid.index]
    trace = heatmap(
        grid.to_numpy() * 100,
        rows,
        "%{y} expert %{x}<br>%{z:.1f}% of the token's routings (%{customdata:,} times)",
        x=list(range(n_experts)),
        customdata=counts.to_numpy(),
        scale="% of routings",
        zmin=0,
    )
    return figure(
        [trace],
        f"Which experts take {label} in each block",
        height=heat_height(len(rows), lo=220, per=22),
        yaxis=reversed_axis(),
        xaxis={"title": "expert"},
    )


def matches(atlas: Atlas, config: dict) -> bool:
    """Whether the atlas counted a model of this shape (blocks, experts, vocabulary), so its experts are these."""
    mine = atlas.summary.get("config", {})
    fields = ("n_layers", "n_dense_layers", "n_routed_experts", "n_activated_experts", "vocab_size", "dim")
    return all(mine.get(f) == config.get(f) for f in fields)


# --- routing bias ---------------------------------------------------------------------------------------------
def bias_figure(atlas: Atlas) -> go.Figure:
    bias = atlas.tables["bias_effect"].sort_values("block")
    tokens = max(int(atlas.summary.get("tokens", 0)), 1)
    x = [f"block {b}" for b in bias["block"]]
    trace = {
        "type": "bar",
        "x": x,
        "y": bias["tokens_changed"] / tokens * 100,
        "customdata": np.stack([bias["tokens_changed"], bias["selections_changed"]], axis=-1),
        "marker": {"color": COLORS["moe"]},
        "hovertemplate": "%{x}<br>%{y:.1f}% of tokens (%{customdata[0]:,}) choose another set because of the bias"
        "<br>%{customdata[1]:,} selections changed<extra></extra>",
    }
    return figure(
        [trace],
        "The correction bias: tokens whose experts it changes",
        height=300,
        yaxis={"title": "% of tokens", "rangemode": "tozero"},
    )


def _measured(atlas: Atlas, count: str) -> pd.DataFrame | None:
    """The block_measures rows, by block, of the blocks that counted any ``count``; None for an atlas
    without the block measures (built before them) or where no block did."""
    table = atlas.tables.get("block_measures")
    if table is None:
        return None
    table = table[table[count] > 0].sort_values("block")
    return None if table.empty else table


def near_tie_figure(atlas: Atlas) -> go.Figure | None:
    """Per MoE block, the share of routings that were near-ties (margin below 1e-3), of the experts and
    of the groups; None for an atlas without the block measures."""
    table = _measured(atlas, "routings")
    if table is None:
        return None
    x = [f"block {b}" for b in table["block"]]
    traces = [
        {
            "type": "bar",
            "x": x,
            "y": table[column] * 100,
            "customdata": table[count],
            "name": name,
            "marker": {"color": COLORS[colour]},
            "hovertemplate": f"%{{x}}<br>%{{y:.2f}}% of routings (%{{customdata:,}}) {name}<extra></extra>",
        }
        for column, count, name, colour in (
            ("near_tie_share", "near_ties", "near-tie experts", "moe"),
            ("group_near_tie_share", "group_near_ties", "near-tie groups", "attention"),
        )
        if table[column].notna().any()
    ]
    title = "Near-ties: routings whose margin (last chosen - best unchosen) is below 1e-3"
    return figure(traces, title, height=300, yaxis={"title": "% of routings", "rangemode": "tozero"})


# --- the indexer ----------------------------------------------------------------------------------------------
def overlap_figure(atlas: Atlas) -> go.Figure | None:
    """Per block, the mean Jaccard overlap of the indexer's selection with the block before's; None
    for an atlas without the block measures or where no query saw more than index_topk keys."""
    table = _measured(atlas, "overlap_queries")
    if table is None:
        return None
    trace = {
        "type": "bar",
        "x": [f"block {b}" for b in table["block"]],
        "y": table["overlap_prev"],
        "customdata": table["overlap_queries"],
        "marker": {"color": COLORS["attention"]},
        "hovertemplate": "%{x}<br>mean overlap %{y:.3f} over %{customdata:,} queries<extra></extra>",
    }
    title = "How much each block's picks overlap the block before's (mean Jaccard, queries past index_topk)"
    return figure([trace], title, height=300, yaxis={"title": "overlap", "range": [0, 1.02]})


def distance_figure(atlas: Atlas) -> go.Figure:
    """Block x log2 distance: where the selected keys lie behind their query, as a share per block."""
    dist = atlas.tables["indexer_distance"]
    grid = dist.pivot(index="block", columns="distance_bin", values="count").fillna(0).sort_index()
    share = grid.div(grid.sum(axis=1).where(lambda s: s > 0, 1), axis=0) * 100
    labels = [_distance_label(int(b)) for b in grid.columns]
    rows = [f"block {b}" for b in grid.index]
    trace = heatmap(share.to_numpy(), rows, "%{y}, keys %{x} back<br>%{z:.1f}% of the selected keys", x=labels, scale="% of keys")
    return figure(
        [trace],
        "How far back the indexer's picks reach (query position − key position)",
        height=heat_height(len(rows), per=22),
        yaxis=reversed_axis(),
        xaxis={"title": "distance", "type": "category"},
    )


def _distance_label(b: int) -> str:
    return "0" if b < 0 else f"{2**b}–{2 ** (b + 1) - 1}" if b > 0 else "1"


def recall_figure(atlas: Atlas) -> go.Figure | None:
    recall = atlas.tables["indexer_recall"].sort_values("block")
    recall = recall[recall["queries"] > 0]
    if recall.empty:
        return None
    x = [f"block {b}" for b in recall["block"]]
    traces = [
        {
            "type": "scatter",
            "x": x,
            "y": recall["p50"],
            "mode": "markers",
            "name": "median (bars: p10-p90)",
            "marker": {"color": COLORS["attention"], "size": 9},
            "error_y": {
                "type": "data",
                "symmetric": False,
                "array": recall["p90"] - recall["p50"],
                "arrayminus": recall["p50"] - recall["p10"],
            },
            "customdata": np.stack([recall["queries"], recall["mean"]], axis=-1),
            "hovertemplate": "%{x}: median %{y:.3f}, mean %{customdata[1]:.3f}<br>over %{customdata[0]:,} queries<extra></extra>",
        }
    ]
    return figure(
        traces,
        "Attention mass the selected keys keep (queries that see more keys than index_topk)",
        height=320,
        yaxis={"title": "recall", "range": [0, 1.02]},
    )


def sinks(atlas: Atlas, block: int, top: int = 15) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The key positions and the tokens the indexer keeps from afar more often than its rate at those
    distances predicts, in one block: two frames, highest lift first."""
    table = atlas.tables["indexer_sinks"]
    table = table[table["block"] == block].sort_values(["lift", "selected"], ascending=False)
    columns = ["selected", "visible", "expected", "lift"]
    by_position = table[table["token_id"] < 0].head(top)[["position", *columns]]
    by_token = table[table["position"] < 0].head(top)
    by_token = by_token.assign(token=by_token["token"].map(lambda t: show_token(t, html_escape=False)))
    return by_position.reset_index(drop=True), by_token[["token", "token_id", *columns]].reset_index(drop=True)


# the Atlas page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("atlas_source", "Atlas: bundled, a directory or an upload"),
    Key("atlas_dir", "Atlas: the directory typed"),
    Key("atlas_upload", "Atlas: the uploaded zip"),
    Key("atlas_section", "Atlas: the section shown"),
    Key("atlas_block", "Atlas: the block"),
    Key("atlas_expert", "Atlas: the expert"),
    Key("atlas_sorted", "Atlas: the expert load sorted"),
    Key("atlas_load", "Atlas: the expert load as counts or shares"),
    Key("atlas_imbalance", "Atlas: the imbalance measure"),
    Key("atlas_groups", "Atlas: group load shown"),
    Key("atlas_pairs", "Atlas: co-activation as counts or lift"),
    Key("atlas_lift", "Atlas: the lift's smoothing"),
    Key("atlas_bias", "Atlas: the routing bias's view"),
    Key("atlas_distance", "Atlas: the indexer distance's view"),
    Key("atlas_recall", "Atlas: the recall's view"),
    Key("atlas_sink_block", "Atlas: the block whose sinks are listed"),
    Key("atlas_csv_", "Atlas: a table's CSV button (the table)", family=True),
    Key("atlas_search", "Atlas: the experts table's search text"),
    Key("atlas_token", "Atlas: the token searched (its text or id)"),
    Key("atlas_token_figure", "Atlas: the searched token's experts figure"),
    Key("atlas_opened", "Atlas: the atlas this session opened last (the Router page draws its experts)"),
)
