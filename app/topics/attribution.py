"""Attribution: which parts of the final stream made one logit (tracing.analyses.attribution), and the
contribution graph (tracing.analyses.flow). Shaping from the trace's attribution table and sites, and the
page's figures: the largest parts as a waterfall, blocks x parts, one block's heads and experts
(each expert with the tokens its output promotes and suppresses), the prompt coloured by what each
token brought through the attention, and the graph of positions x blocks."""

from __future__ import annotations

import html
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from tracing.analyses.attribution import AttributionRequest
from tracing.tables.frames import ATTRIBUTION_PARTS, attribution_table
from tracing.trace import Trace

from .figures import (
    COLORS,
    DIVERGING,
    figure,
    heat_height,
    heatmap,
    outlier_note,
    positions,
    reversed_axis,
    symmetric_range,
    with_outliers,
)
from .tokens import show_token

# component cards -> what their attribution shows (the cards link to the page for the chosen block)
CARD_PARTS = {
    "embedding": "the embedding's part",
    "block": "this block's parts",
    "mla": "this block's heads",
    "indexer": "this block's heads by key",
    "sparse_mask": "this block's heads by key",
    "mlp": "this block's MLP",
    "router": "this block's experts",
    "experts": "this block's experts",
    "head": "the prediction's parts",
}
TOP_PARTS = 12  # parts the waterfall shows one by one; the others as one bar
EDGE_WIDTHS = ((0.0, 0.2, 1.2), (0.2, 0.5, 2.5), (0.5, 1.0, 4.0))  # (share above, up to, line width) of the graph's edges


def variant(request: AttributionRequest, flow: bool) -> str:
    """The store's name for an attributed trace of a prompt (TraceKey.variant), readable as its origin."""
    what = f"attribution at {request.position}, target {request.target}"
    if request.contrast is not None:
        what += f" minus {request.contrast}"
    return what + (" with the graph" if flow else "")


def attributed(trace: Trace) -> dict | None:
    """The trace's attribution (position, target, contrast, total, rest) when it holds one."""
    info = trace.extra.get("attribution")
    if not info or "attribution.total" not in trace:
        return None
    return {**info, "total": float(trace["attribution.total"][0]), "rest": float(trace["attribution.rest"][0])}


def token_name(trace: Trace, token_id: int | None) -> str:
    """A token id as its string (from the run's vocabulary), shown."""
    if token_id is None:
        return ""
    return show_token(trace.extra.get("vocab", {}).get(str(int(token_id)), f"<{int(token_id)}>"), html_escape=False)


def what(trace: Trace) -> str:
    """The attributed logit in words: "the logit of 'x'", "... minus that of 'y'"."""
    info = trace.extra["attribution"]
    words = f"the logit of {token_name(trace, info['target'])!r}"
    if info["contrast"] is not None:
        words += f" minus that of {token_name(trace, info['contrast'])!r}"
    return words


def rest_share(coarse: pd.DataFrame, rest: float) -> float:
    """The rest's size as a share of the parts' total size (coarse_parts): how nearly the parts sum to the logit."""
    return abs(rest) / max(float(coarse.loc[coarse["kind"] != "rest", "value"].abs().sum()), 1e-30)


def candidates(trace: Trace, position: int) -> list[int]:
    """The token ids the position predicts most (its top 10, best first): targets and contrasts to pick."""
    if "next.topk_indices" not in trace:
        return []
    return trace["next.topk_indices"][position].tolist()


# --- the parts ----------------------------------------------------------------------------------------------
def coarse_parts(trace: Trace) -> pd.DataFrame:
    """The embedding, each block's attention (its heads together) and FFN (experts and shared, or the
    MLP), and the rest: label, block, kind, value."""
    table = attribution_table(trace)
    parts = table[table["kind"].isin(ATTRIBUTION_PARTS)]
    stage = np.where(parts["kind"] == "head", "attention", np.where(parts["kind"] == "embed", "embedding", "ffn"))
    grouped = parts.assign(stage=stage).groupby(["block", "stage"], sort=True)["value"].sum().reset_index()
    labels = [
        "embedding" if stage == "embedding" else f"block {b} {'attention' if stage == 'attention' else 'FFN'}"
        for b, stage in zip(grouped["block"], grouped["stage"], strict=True)
    ]
    frame = pd.DataFrame({"label": labels, "block": grouped["block"], "kind": grouped["stage"], "value": grouped["value"]})
    rest = pd.DataFrame(
        [{"label": "rest (bf16 carry)", "block": -1, "kind": "rest", "value": float(trace["attribution.rest"][0])}]
    )
    return pd.concat([frame, rest], ignore_index=True)


def waterfall_figure(coarse: pd.DataFrame, total: float, what: str) -> go.Figure:
    """The largest parts by |value|, one bar each in model order, the others as one, and the total."""
    order = coarse["value"].abs().sort_values(ascending=False).index
    shown = coarse.loc[sorted(order[:TOP_PARTS])]
    others = coarse.drop(index=shown.index)
    labels, values = list(shown["label"]), list(shown["value"])
    if len(others):
        labels.append(f"{len(others)} other parts")
        values.append(float(others["value"].sum()))
    bar = {
        "type": "waterfall",
        "x": [*labels, "total"],
        "y": [*values, total],
        "measure": ["relative"] * len(values) + ["total"],
        "increasing": {"marker": {"color": COLORS["stream"]}},
        "decreasing": {"marker": {"color": COLORS["moe"]}},
        "totals": {"marker": {"color": COLORS["attention"]}},
        "hovertemplate": "%{x}<br>%{y:+.4f}<extra></extra>",
    }
    return figure([bar], f"The largest parts of {what}", height=340, yaxis={"title": {"text": "logit"}})


def block_grid(trace: Trace) -> tuple[np.ndarray, list[str], list[str]] | None:
    """[blocks, H + 2]: each head's part, then the routed experts' together and the shared expert's
    (the MLP's in a dense block, under 'shared / MLP'); NaN where a block has no routed experts."""
    blocks = trace.layers_with("attn.attribution")
    if not blocks:
        return None
    heads = trace.config.n_heads
    grid = np.full((len(blocks), heads + 2), np.nan)
    for row, i in enumerate(blocks):
        grid[row, :heads] = trace.site(i, "attn.attribution").numpy()
        ffn = trace.site(i, "ffn.attribution").numpy()
        if len(ffn) == 1:
            grid[row, -1] = ffn[0]
        else:
            grid[row, -2:] = ffn[:-1].sum(), ffn[-1]
    columns = [f"head {h}" for h in range(heads)] + ["routed experts", "shared / MLP"]
    return grid, [f"block {i}" for i in blocks], columns


def grid_figure(grid: np.ndarray, rows: list[str], columns: list[str]) -> go.Figure:
    """Blocks x parts on a symmetric scale (0 white) that covers the bulk: a part far larger than the
    rest is marked ▲ and named, not left to wash the others out."""
    scale = symmetric_range(grid)
    heat = heatmap(grid, rows, "%{y} · %{x}<br>%{z:+.4f}", x=columns, colorscale=DIVERGING)
    heat = with_outliers(heat, scale, "logit", symmetric=True)
    heat["colorbar"].update(len=1.0, lenmode="fraction", thickness=14)
    title = "Each block's parts: heads, routed experts, shared expert or MLP"
    title += outlier_note(grid, scale.outliers, columns, "part")
    return figure(
        [heat],
        title,
        height=heat_height(len(rows), lo=320, per=26),  # tall enough for a colour bar with readable ticks
        yaxis=reversed_axis(),
        xaxis={"tickangle": -45, "tickfont": {"size": 10}},
    )


def dropped_by_block(trace: Trace) -> pd.DataFrame | None:
    """Per block: what the keys the indexer dropped would have added to the logit (its heads'
    ``attn.attribution_dropped`` summed) beside what its attention did add; None without them."""
    blocks = trace.layers_with("attn.attribution_dropped")
    if not blocks:
        return None
    rows = [
        (
            i,
            float(trace.site(i, "attn.attribution_dropped").double().sum()),
            float(trace.site(i, "attn.attribution").double().sum()),
        )
        for i in blocks
    ]
    return pd.DataFrame(rows, columns=["block", "dropped", "attention"])


def dropped_figure(frame: pd.DataFrame) -> go.Figure:
    """One bar per block: dense attention's update less the sparse one's, along the target direction."""
    values = frame["dropped"]
    bar = {
        "type": "bar",
        "x": [f"block {b}" for b in frame["block"]],
        "y": values,
        "marker": {"color": np.where(values >= 0, COLORS["stream"], COLORS["moe"]).tolist()},
        "customdata": frame["attention"],
        "hovertemplate": "%{x}<br>dropped keys %{y:+.4f}<br>the attention's part %{customdata:+.4f}<extra></extra>",
    }
    title = "What the dropped keys would have added, per block (dense less sparse attention)"
    return figure([bar], title, height=300, yaxis={"title": {"text": "logit"}})


@dataclass
class BlockParts:
    heads: pd.DataFrame  # head, value
    ffn: pd.DataFrame  # label, expert (-1: shared or MLP), value, promotes, suppresses


def block_parts(trace: Trace, block: int) -> BlockParts | None:
    """One block's heads and FFN parts; each chosen routed expert with the tokens its weighted output
    promotes and suppresses most (the per-expert logit lens), when the trace holds it."""
    heads = trace.site(block, "attn.attribution")
    if heads is None:
        return None
    ffn = trace.site(block, "ffn.attribution").numpy()
    lens = trace.site(block, "ffn.expert_lens.ids")
    rows = []
    if len(ffn) == 1:
        rows.append(("MLP", -1, float(ffn[0]), "", ""))
    else:
        for e in np.flatnonzero(ffn[:-1]):
            words = ["", ""] if lens is None else [" ".join(token_name(trace, i) for i in lens[e, d].tolist()) for d in (0, 1)]
            rows.append((f"expert {e}", int(e), float(ffn[e]), *words))
        rows.append(("shared expert", -1, float(ffn[-1]), "", ""))
    frame = pd.DataFrame(rows, columns=["label", "expert", "value", "promotes", "suppresses"])
    return BlockParts(pd.DataFrame({"head": np.arange(len(heads)), "value": heads.numpy()}), frame)


def heads_figure(parts: BlockParts, block: int) -> go.Figure:
    values = parts.heads["value"]
    bar = {
        "type": "bar",
        "x": [f"head {h}" for h in parts.heads["head"]],
        "y": values,
        "marker": {"color": np.where(values >= 0, COLORS["stream"], COLORS["moe"]).tolist()},
        "hovertemplate": "%{x}<br>%{y:+.4f}<extra></extra>",
    }
    return figure([bar], f"Block {block}: each head's part", height=300, yaxis={"title": {"text": "logit"}})


def ffn_figure(parts: BlockParts, block: int) -> go.Figure:
    frame = parts.ffn
    hover = [
        f"promotes: {html.escape(up)}<br>suppresses: {html.escape(down)}" if up else ""
        for up, down in zip(frame["promotes"], frame["suppresses"], strict=True)
    ]
    bar = {
        "type": "bar",
        "x": frame["value"],
        "y": frame["label"],
        "orientation": "h",
        "marker": {"color": np.where(frame["value"] >= 0, COLORS["stream"], COLORS["moe"]).tolist()},
        "text": [html.escape(up.split(" ")[0]) if up else "" for up in frame["promotes"]],
        "textposition": "auto",
        "customdata": hover,
        "hovertemplate": "%{y}: %{x:+.4f}<br>%{customdata}<extra></extra>",
    }
    title = f"Block {block}: the experts' parts (text: the token each promotes most)"
    return figure([bar], title, height=140 + 28 * len(frame), yaxis=reversed_axis(), xaxis={"title": {"text": "logit"}})


# --- the prompt's tokens ---------------------------------------------------------------------------------------
def source_totals(trace: Trace) -> np.ndarray | None:
    """[T]: what each position's stream brought to the target through the attention, directly: its
    part summed over heads and blocks (keys the indexer dropped bring exactly 0)."""
    blocks = trace.layers_with("attn.attribution_src")
    if not blocks:
        return None
    return sum(trace.site(i, "attn.attribution_src").double().sum(0).numpy() for i in blocks)


def coloured_prompt(trace: Trace, totals: np.ndarray, position: int) -> str:
    """The tokens up to the position, each on a background green (raised the target) or red (lowered
    it) as strong as its part; the position outlined. HTML, every token escaped."""
    bound = float(np.abs(totals).max()) or 1.0
    spans = []
    for s, token in enumerate(trace.tokens[: position + 1]):
        value = float(totals[s])
        hue = 130 if value >= 0 else 0
        alpha = abs(value) / bound
        outline = ";outline:2px solid #333" if s == position else ""
        tip = html.escape(f"position {s} · {value:+.4f} through the attention")
        text = html.escape(token).replace("\n", "⏎<br>")
        spans.append(
            f'<span class="attributed-token" title="{tip}" style="background:hsla({hue}, 70%, 50%, {alpha:.2f});'
            f'border-radius:3px;padding:0 1px{outline}">{text}</span>'
        )
    return f'<div style="white-space:pre-wrap;line-height:1.9">{"".join(spans)}</div>'


# --- the contribution graph ----------------------------------------------------------------------------------
@dataclass
class Graph:
    """Edges (x0, level0, x1, level1, share, kind) that reach the position's last stream, and FFN
    nodes (x, level, label) with their top experts. Levels: 0 the embedding, 2i + 1 block i's stream
    after the attention, 2i + 2 after its FFN."""

    edges: pd.DataFrame
    nodes: pd.DataFrame
    levels: list[str]


TOP_EDGES = 3  # the graph's default: each stream's three largest incoming edges


def _kept(shares: np.ndarray, threshold: float | None, top: int | None) -> np.ndarray:  # (n,) bool
    """Which of one receiving stream's incoming shares are drawn: its ``top`` largest (above 0), or
    those above ``threshold``. The largest few show the path at any prompt length, where one threshold
    shows a tangle on a short prompt and nothing on a long one (the shares spread over more keys)."""
    if top is None:
        return shares > threshold
    keep = np.zeros(shares.shape, dtype=bool)
    order = np.argsort(-shares, kind="stable")[:top]
    keep[order[shares[order] > 0]] = True
    return keep


def flow_graph(trace: Trace, position: int, threshold: float | None = None, top: int = TOP_EDGES) -> Graph | None:
    """The contribution graph from the position's last stream back to the embeddings: per receiving
    stream, only its ``top`` largest incoming edges (or, given a ``threshold``, those with a share
    above it) and, from there, only what feeds them (a key the indexer dropped has share 0 and is
    never drawn)."""
    blocks = trace.layers_with("attn.flow")
    if not blocks:
        return None
    top = None if threshold is not None else top
    edges, nodes = [], []
    reached = {position}
    for i in reversed(blocks):
        mid, post = 2 * i + 1, 2 * i + 2
        shares, stayed = trace.site(i, "ffn.flow").numpy(), trace.site(i, "ffn.flow_resid").numpy()
        for t in sorted(reached):
            brought = float(shares[t].sum())
            keep_stay, keep_ffn = _kept(np.array([stayed[t], brought]), threshold, top)
            if keep_stay:
                edges.append((t, mid, t, post, float(stayed[t]), "residual"))
            if keep_ffn:
                edges.append((t, mid, t, post, brought, "ffn"))
                nodes.append((t, mid + 0.5, _ffn_label(shares[t], threshold or 0.0), brought))
        keys, kept = trace.site(i, "attn.flow").numpy(), trace.site(i, "attn.flow_resid").numpy()
        below = set()
        for t in sorted(reached):  # every reached stream at `post` came from its stream at `mid`
            incoming = _kept(np.concatenate([[kept[t]], keys[t]]), threshold, top)  # (1 + S,): the residual, then each key
            if incoming[0]:
                edges.append((t, 2 * i, t, mid, float(kept[t]), "residual"))
                below.add(t)
            for s in np.flatnonzero(incoming[1:]):
                edges.append((int(s), 2 * i, t, mid, float(keys[t, s]), "attention"))
                below.add(int(s))
        reached = below
    levels = ["embedding"] + [name for i in blocks for name in (f"{i} attention", f"{i} FFN")]
    return Graph(
        pd.DataFrame(edges, columns=["x0", "y0", "x1", "y1", "share", "kind"]),
        pd.DataFrame(nodes, columns=["x", "y", "label", "share"]),
        levels,
    )


def _ffn_label(shares: np.ndarray, threshold: float) -> str:
    """The FFN's parts above the threshold, largest first: ``e5 .31 · shared .12`` (``MLP`` in a dense block)."""
    if len(shares) == 1:
        return f"MLP {shares[0]:.2f}"
    names = [f"e{e}" for e in range(len(shares) - 1)] + ["shared"]
    order = [j for j in np.argsort(-shares) if shares[j] > threshold][:3]
    return " · ".join(f"{names[j]} {shares[j]:.2f}" for j in order) or "experts"


def labels_fit(graph: Graph, width: float = 900.0, char: float = 5.5) -> bool:
    """Whether each FFN square's label (``e5 0.31 · shared 0.12``, written to its right) clears the next
    square of its row at a full page's plot width: on a long prompt they run into each other and are
    left to the hover."""
    if graph.nodes.empty:
        return True
    xs = np.concatenate([graph.edges[["x0", "x1"]].to_numpy().ravel(), graph.nodes["x"].to_numpy()])
    per_position = width / (xs.max() - xs.min() + 1)  # pixels per drawn position
    needed = char * graph.nodes["label"].str.len().max() + 12  # the square and the text
    gaps = [np.diff(np.sort(row["x"].to_numpy())) for _, row in graph.nodes.groupby("y")]
    return all(gap.size == 0 or gap.min() * per_position >= needed for gap in gaps)


def edge_rule(top: int, threshold: float | None) -> str:
    """Which edges the graph draws, in words for its title."""
    return f"edges with a share above {threshold:g}" if threshold is not None else f"each stream's top {top} edges"


def flow_figure(graph: Graph, labels: list[str], position: int, rule: str = f"each stream's top {TOP_EDGES} edges") -> go.Figure:
    """The graph's edges, wider for larger shares; ``rule`` (which edges are drawn) goes in the title."""
    written = labels_fit(graph)
    colours = {"attention": COLORS["attention"], "residual": COLORS["norm"], "ffn": COLORS["ffn"]}
    traces = []
    for kind, colour in colours.items():
        chosen = graph.edges[graph.edges["kind"] == kind]
        first = True
        for low, high, width in EDGE_WIDTHS:
            part = chosen[(chosen["share"] > low) & (chosen["share"] <= high)]
            if part.empty:
                continue
            gap = np.full(len(part), np.nan)
            xs = np.column_stack([part["x0"], part["x1"], gap]).ravel()
            ys = np.column_stack([part["y0"], part["y1"], gap]).ravel()
            traces.append(
                {
                    "type": "scatter",
                    "mode": "lines",
                    "x": [labels[int(v)] if np.isfinite(v) else None for v in xs],
                    "y": [float(v) if np.isfinite(v) else None for v in ys],
                    "line": {"color": colour, "width": width},
                    "name": kind,
                    "legendgroup": kind,
                    "showlegend": first,
                    "hoverinfo": "skip",
                }
            )
            first = False
    heads = graph.edges[graph.edges["kind"] == "attention"][["x1", "y1"]].drop_duplicates()
    if not heads.empty:  # one point per block and receiving position: the heads that fed it, to click
        blocks = ((heads["y1"] - 1) // 2).astype(int)
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "x": [labels[int(x)] for x in heads["x1"]],
                "y": (heads["y1"] - 0.5).tolist(),
                "customdata": [["attention", b, int(t)] for b, t in zip(blocks, heads["x1"], strict=True)],
                "marker": {"symbol": "diamond", "size": 8, "color": COLORS["attention"]},
                "name": "heads (click)",
                "hovertemplate": "%{x}<br>block %{customdata[1]}'s heads into it: click for each head<extra></extra>",
            }
        )
    if not graph.nodes.empty:
        blocks = ((graph.nodes["y"] - 1.5) // 2).astype(int)
        traces.append(
            {
                "type": "scatter",
                "mode": "markers+text" if written else "markers",
                "x": [labels[int(x)] for x in graph.nodes["x"]],
                "y": graph.nodes["y"],
                "text": graph.nodes["label"],
                "customdata": [["ffn", b, int(t)] for b, t in zip(blocks, graph.nodes["x"], strict=True)],
                "textposition": "middle right",
                "cliponaxis": False,
                "textfont": {"size": 9},
                "marker": {"symbol": "square", "size": 8, "color": COLORS["ffn"]},
                "name": "FFN (experts)",
                "hovertemplate": "%{x}<br>%{text}<br>click for each expert<extra></extra>",
            }
        )
    ticks = list(range(len(graph.levels)))
    title = f"Contribution graph into position {position}: {rule}; keys the indexer dropped never drawn"
    if not written:
        title += "; hover a square for its experts' shares"
    title += "; click a diamond (heads) or a square (experts) for its detail"
    return figure(
        traces,
        title,
        height=heat_height(len(graph.levels), lo=320, per=34, hi=1400),
        xaxis=positions(labels, "position", dtick=1),  # only the positions the graph reaches are drawn
        yaxis={"tickvals": ticks, "ticktext": graph.levels, "title": {"text": "stream after"}},
    )
