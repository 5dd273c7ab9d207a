"""Interventions: a baseline and an intervened trace of one prompt, compared (tracing.analyses.diff): where
the stream starts to move, which experts, keys and lens predictions changed, how the next token moved.
Also what the page picks per block (experts to ablate or zero, heads to ablate) as plain values, and the
figure of one prompt on two checkpoints."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from model.config import ModelArgs
from tracing.analyses.attribution import removable
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import AblateHeads
from tracing.errors import InputError
from tracing.trace import Trace

from .figures import (
    COLORS,
    cells_note,
    figure,
    group_lines,
    heatmap,
    outlier_note,
    positions,
    reversed_axis,
    right_axis,
    robust_range,
    rows_figure,
    with_outliers,
    write_cells,
)
from .tokens import show_token

_DRIFT_SITES = {"resid_pre": "in", "resid_mid": "after attention", "resid_post": "out"}


BEFORE, AFTER = "#9D9D9D", COLORS["moe"]  # baseline, intervened


@dataclass
class Drift:
    rows: list[str]  # "x₀ (embedding)", "block 0 · after attention", "block 0 · out", ...
    rel_l2: np.ndarray  # [R, T] |x_b - x_a| / |x_a|
    cosine: np.ndarray  # [R, T] cos(x_a, x_b)


def drift(stream: pd.DataFrame | None, n_tokens: int) -> Drift | None:
    """From diff_tables()['stream']: the streams' relative L2 distance and cosine as (point in the
    network) × position grids, in the order the stream flows. A block's input is shown only where the
    previous block's output (the same values) is not."""
    if stream is None or stream.empty:
        return None
    have = set(zip(stream["block"], stream["site"], strict=True))
    rows, rel, cos = [], [], []
    for (layer, site), part in stream.groupby(["block", "site"], sort=False):
        if site == "resid_pre" and (layer - 1, "resid_post") in have:
            continue
        part = part.sort_values("position")
        if len(part) != n_tokens:
            continue
        rows.append("x₀ (embedding)" if (layer, site) == (0, "resid_pre") else f"block {layer} · {_DRIFT_SITES[site]}")
        rel.append(part["rel_l2"].to_numpy())
        cos.append(part["cosine"].to_numpy())
    if not rows:
        return None
    return Drift(rows, np.vstack(rel), np.vstack(cos))


def changes_per_block(tables: dict[str, pd.DataFrame], n_layers: int) -> pd.DataFrame:
    """Per block: the largest and mean relative L2 drift of its output over positions, and at how many
    positions its experts, its indexer keys and its logit-lens top-1 changed (NaN where the trace has
    none, as for the dense blocks' experts)."""
    out = pd.DataFrame({"block": np.arange(n_layers)}).set_index("block")
    stream = tables.get("stream")
    if stream is not None:
        post = stream[stream["site"] == "resid_post"].groupby("block")["rel_l2"]
        out["max_rel_l2"], out["mean_rel_l2"] = post.max(), post.mean()
    for name, column in (("experts", "experts_changed"), ("indexer_keys", "keys_changed"), ("predictions", "top1_changed")):
        frame = tables.get(name)
        if frame is not None:
            out[column] = frame.groupby("block")["changed"].sum()
    return out.reset_index()


@dataclass
class LensChange:
    layers: list[int]
    changed: np.ndarray  # [L, T] 1.0 where the top-1 token changed, else 0.0
    text: np.ndarray  # [L, T] the intervened top-1 where it changed, else ""
    hover: np.ndarray  # [L, T] "before p → after p"


def lens_changes(predictions: pd.DataFrame | None, n_tokens: int) -> LensChange | None:
    """From diff_tables()['predictions']: where the logit lens's top-1 token changed, and to what."""
    if predictions is None or predictions.empty:
        return None
    layers = sorted(predictions["block"].unique().tolist())
    frame = predictions.sort_values(["block", "position"])
    if len(frame) != len(layers) * n_tokens:
        return None
    shape = (len(layers), n_tokens)
    changed = frame["changed"].to_numpy().reshape(shape)
    before = [show_token(str(t)) for t in frame["top1_a"]]
    after = [show_token(str(t)) for t in frame["top1_b"]]
    if "prob_a" in frame and "prob_b" in frame:
        pa, pb = frame["prob_a"].to_numpy(), frame["prob_b"].to_numpy()
        hover = [f"{a} {p:.3f} → {b} {q:.3f}" for a, p, b, q in zip(before, pa, after, pb, strict=True)]
    else:
        hover = [f"{a} → {b}" for a, b in zip(before, after, strict=True)]
    short = np.asarray([show_token(str(t), limit=10) for t in frame["top1_b"]], dtype=object).reshape(shape)
    return LensChange(
        layers,
        changed.astype(np.float64),
        np.where(changed, short, ""),
        np.asarray(hover, dtype=object).reshape(shape),
    )


def next_token_change(frame: pd.DataFrame | None) -> pd.DataFrame | None:
    """diff_tables()['next_token'] with the tokens shown for hovers and axes."""
    if frame is None or frame.empty:
        return None
    frame = frame.copy()
    shown = [show_token(str(t)) for t in frame["token"]]
    repeated = {t for t in shown if shown.count(t) > 1}  # one bar per token id, even where two read alike
    frame["shown"] = [f"{t} (id {i})" if t in repeated else t for t, i in zip(shown, frame["token_id"], strict=True)]
    return frame


# the diff tables (tracing.analyses.diff.diff_tables) as the page lists them: title, what a row is
TABLES = {
    "stream": (
        "Residual stream",
        "Per block, point (in, after attention, out) and position: relative L2 distance and cosine of the streams.",
    ),
    "experts": ("Experts", "Per MoE block and position: the experts each run chose, how many differ, their Jaccard overlap."),
    "indexer_keys": ("Indexer keys", "Per block and query position: the keys the indexer selected in each run."),
    "predictions": ("Logit lens", "Per block and position: the logit lens's top-1 token in each run, with its probability."),
    "next_token": ("Next token", "The top next tokens of either run after the last position, with both probabilities."),
    "blocks": (
        "Per block",
        "One row per block, means over positions: the output's drift (relative L2, cosine), the experts' and keys' "
        "Jaccard and the share of positions whose set changed, the attention's total variation.",
    ),
    "attention": (
        "Attention",
        "Per block and query position: the total variation ½ Σ|p_a − p_b| of the attention over the keys (mean over "
        "heads), the key each run reads most, each run's share of mass on the keys the other's indexer selected (at the "
        "queries where it drops a key: elsewhere the share is 1 by construction).",
    ),
    "logits": ("Logits", "Per position: KL(p_a ‖ p_b) of the next-token distributions and both top-1 tokens."),
}


def moe_block_ids(cfg: ModelArgs) -> list[int]:
    """The blocks an ablation or the router's bias can be changed in."""
    return list(range(cfg.n_dense_layers, cfg.n_layers))


@dataclass(frozen=True)
class PerBlock:
    """An intervention the page picks block by block: its ``from_spec`` key, the session-state keys of
    its widgets, and what it removes (routed experts of the MoE blocks, or heads of every block)."""

    spec_key: str  # "ablate", "zero_experts" or "ablate_heads"
    flag: str  # the command line's flag, whose LAYER:ID,... syntax the typed text takes
    prefix: str  # + block: the ids picked in that block
    block_key: str  # the block whose ids are being picked
    text_key: str  # ids typed as LAYER:ID,...
    heads: bool = False  # heads of every block, else routed experts of the MoE blocks

    def blocks(self, cfg: ModelArgs) -> list[int]:
        return list(range(cfg.n_layers)) if self.heads else moe_block_ids(cfg)

    def ids(self, cfg: ModelArgs) -> list[int]:
        return list(range(cfg.n_heads if self.heads else cfg.n_routed_experts))

    def block_of(self, key: object) -> int | None:
        """The block a session-state key holds this intervention's picks for, or None."""
        if isinstance(key, str) and key.startswith(self.prefix) and key.removeprefix(self.prefix).isdigit():
            return int(key.removeprefix(self.prefix))
        return None

    @property
    def what(self) -> str:
        return "HEAD" if self.heads else "EXPERT"

    def typed(self, text: str) -> dict[int, tuple[int, ...]]:
        """``LAYER:ID,...`` as block -> ids, as the flag reads it (InputError when it does not parse)."""
        if not text.strip():
            return {}
        try:
            (change,) = from_spec({self.spec_key: text})
        except InputError:
            raise
        except ValueError:  # a digit int() does not read, as '²': the parser's isdigit() took it
            raise InputError(f"{self.flag} {text!r}: expected LAYER:{self.what},… with the digits 0-9, e.g. 3:17") from None
        return change.heads if isinstance(change, AblateHeads) else change.experts

    def picked(self, state: Mapping, cfg: ModelArgs) -> dict[int, list[int]]:
        """The ids picked in each block plus those typed: ``{block: sorted ids}``, as ``from_spec`` takes it."""
        chosen = {b: set(state.get(f"{self.prefix}{b}") or ()) for b in self.blocks(cfg)}
        for block, ids in self.typed(state.get(self.text_key) or "").items():
            chosen.setdefault(block, set()).update(ids)
        return {b: sorted(int(i) for i in ids) for b, ids in sorted(chosen.items()) if ids}


ABLATE = PerBlock("ablate", "--ablate-experts", "iv_experts_", "iv_block", "iv_ablate_text")
ZERO = PerBlock("zero_experts", "--zero-experts", "iv_zeroed_", "iv_zero_block", "iv_zero_text")
HEADS = PerBlock("ablate_heads", "--ablate-heads", "iv_heads_", "iv_head_block", "iv_head_text", heads=True)
PER_BLOCK = (ABLATE, ZERO, HEADS)  # in from_spec's (and the command line's) order
ARRIVING = "iv_arriving"  # a removal another page asked for: {spec key: {block: [id]}}, run on arrival


def listing(chosen: Mapping[int, list[int]]) -> str:
    """``{1: [0, 3], 2: [1]}`` as the command line writes it: ``1:0,1:3,2:1``."""
    return ",".join(f"{block}:{i}" for block, ids in sorted(chosen.items()) for i in ids)


def ask_to_remove(state: MutableMapping, spec_key: str, block: int, index: int, position: int | None = None) -> None:
    """For a link from another page: the Interventions page opens with only this removal picked (at
    ``position`` only, when given: an attribution's check removes the part where it was attributed),
    and runs it."""
    state[ARRIVING] = {spec_key: {block: [index]}, "at": None if position is None else str(position)}


def strongest_block(trace: Trace) -> int | None:
    """The block of the head or routed expert with the largest |part| in an attributed trace: where
    the Attribution page opens."""
    parts = removable(trace)
    return max(parts, key=lambda p: abs(p[0]))[2] if parts else None


def strongest(trace: Trace, block: int) -> list[tuple[str, int, float]]:
    """In an attributed trace, the block's head and its chosen routed expert with the largest |part|,
    as (the from_spec key that removes it, head or expert, part): the causal check's candidates."""
    best: dict[str, tuple[float, int]] = {}
    for value, key, layer, index in removable(trace):
        if layer == block and abs(value) > abs(best.get(key, (0.0, 0))[0]):
            best[key] = (value, index)
    return [(key, index, value) for key, (value, index) in sorted(best.items())]


@dataclass(frozen=True)
class LogitMove:
    """How the baseline's top next token (after the last position) fared in the intervened run."""

    token_id: int
    before: float  # its logit in the baseline
    after: float  # its logit in the intervened run
    rank_after: int  # 0: still the top prediction


def logit_move(a: Trace, b: Trace) -> LogitMove | None:
    """The logit of the baseline's top next token in both runs: the summary a causal check reads."""
    if "logits.last" not in a or "logits.last" not in b:
        return None
    la, lb = a["logits.last"].double(), b["logits.last"].double()  # (V,)
    top = int(la.argmax())
    return LogitMove(top, float(la[top]), float(lb[top]), int((lb > lb[top]).sum()))


def changed_rows(frame: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of diff table ``name`` where the runs differ."""
    if name == "stream":
        return frame[frame["rel_l2"] > 0]
    if "changed" in frame:
        return frame[frame["changed"]]
    return frame


def drift_figure(d: Drift, labels: list[str]) -> go.Figure:
    """Relative L2 distance between the baseline's and the intervened stream, per point and position,
    on the robust scale: a position that moved far more than the rest (the edited one) would
    otherwise leave every other cell the colour of no change."""
    hover = "%{y}<br>position %{x}<br>relative L2 %{z:.4g}<br>cosine %{customdata:.5f}"
    scale = robust_range(d.rel_l2, lo=0.0)
    heat = with_outliers(heatmap(d.rel_l2, d.rows, hover, x=labels, customdata=d.cosine), scale, "rel. L2")
    title = "How far the residual stream moved: |x_intervened − x_baseline| / |x_baseline|"
    title += outlier_note(d.rel_l2, scale.outliers, labels, "rel. L2")
    return rows_figure([heat], d.rows, title, positions(labels, "position"), lo=320, per=26)


def block_changes_figure(frame: pd.DataFrame, n_tokens: int) -> go.Figure:
    """Per block: positions whose experts, indexer keys or logit-lens top-1 changed (bars), and the
    largest drift of the block's output (line, right axis)."""
    x = [f"block {i}" for i in frame["block"]]
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
    return figure(
        traces,
        "What changed, block by block: positions with other experts, keys, lens top-1",
        height=400,
        barmode="group",
        xaxis={"title": {"text": "block"}},
        yaxis={"title": {"text": "positions changed"}, "range": [0, max(n_tokens, 1)]},
        yaxis2=right_axis("max relative L2", tickformat=".2g"),
    )


def expert_load_change_figure(
    before: np.ndarray, after: np.ndarray, ablated: tuple[int, ...], block: int, per_group: int, zeroed: tuple[int, ...] = ()
) -> go.Figure:
    """Tokens per expert of one MoE block, baseline and intervened; ablated experts crossed out, zeroed
    ones (still chosen, writing nothing) ringed."""
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
    for ids, name, symbol in ((ablated, "ablated", "x"), (zeroed, "zeroed (chosen, writes nothing)", "circle-open")):
        if ids:
            traces.append(
                {
                    "type": "scatter",
                    "x": list(ids),
                    "y": [0] * len(ids),
                    "mode": "markers",
                    "name": name,
                    "marker": {"symbol": symbol, "size": 11, "color": COLORS["marker"]},
                    "hovertemplate": "expert %{x}: " + name + "<extra></extra>",
                }
            )
    e = len(before)
    return figure(
        traces,
        f"Block {block}: tokens per expert, baseline and intervened",
        height=380,
        barmode="group",
        shapes=group_lines(e, per_group, color="#999", width=1, dash="dot"),
        xaxis={"title": {"text": "routed expert (dotted lines: groups)"}},
        yaxis={"title": {"text": "tokens routed"}},
    )


def lens_changes_figure(lc: LensChange, labels: list[str]) -> go.Figure:
    """Where the logit lens's top-1 token changed (the new token written in the cell)."""
    rows = [f"block {i}" for i in lc.layers]
    colors = [[0, "#F2F2F2"], [1, COLORS["ffn"]]]
    heat = heatmap(
        lc.changed,
        rows,
        "%{y} · position %{x}<br>%{customdata}",
        x=labels,
        zmin=0,
        zmax=1,
        colorscale=colors,
        showscale=False,
        customdata=lc.hover,
        xgap=1,
        ygap=1,
    )
    title = "Logit lens: where the top-1 token changed (orange; hover: before → after)" + cells_note(len(labels), "the new token")
    xaxis = positions(labels, "position (predicting the next token)")
    return rows_figure([write_cells(heat, lc.text, len(labels))], rows, title, xaxis, lo=260, per=40)


def next_token_change_figure(df: pd.DataFrame) -> go.Figure:
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
    return figure(
        traces,
        "Next token after the last position, baseline and intervened",
        height=130 + 30 * len(df),
        barmode="group",
        yaxis={**reversed_axis(), "type": "category"},
        xaxis={"title": {"text": "probability"}},
    )


def checkpoint_blocks_figure(blocks: pd.DataFrame, names: tuple[str, str]) -> go.Figure:
    """Two checkpoints on one prompt, per block (diff_tables()['blocks']): the share of positions whose
    experts, indexer keys or most-read key differ, and the attention's total variation (0-1, left),
    the output's mean relative L2 drift (right)."""
    x = [f"block {i}" for i in blocks["block"]]
    traces: list[dict] = []
    for column, name, color in (
        ("experts_changed_share", "experts changed", COLORS["moe"]),
        ("keys_changed_share", "indexer keys changed", COLORS["attention"]),
        ("top_key_changed_share", "most-read key changed", COLORS["ffn"]),
    ):
        if blocks[column].notna().any():
            traces.append(
                {
                    "type": "bar",
                    "x": x,
                    "y": blocks[column],
                    "name": name,
                    "marker": {"color": color},
                    "hovertemplate": "%{x}: " + name + " at %{y:.0%} of the positions<extra></extra>",
                }
            )
    for column, name, color, axis, shown in (
        ("attn_tv", "attention moved (total variation)", COLORS["marker"], "y", ".3f"),
        ("rel_l2_mean", "output drift (mean rel. L2)", COLORS["stream"], "y2", ".4g"),
    ):
        if blocks[column].notna().any():
            traces.append(
                {
                    "type": "scatter",
                    "x": x,
                    "y": blocks[column],
                    "yaxis": axis,
                    "mode": "lines+markers",
                    "name": name,
                    "line": {"color": color},
                    "hovertemplate": "%{x}: " + name + " %{y:" + shown + "}<extra></extra>",
                }
            )
    return figure(
        traces,
        f"{names[1]} against {names[0]}, block by block: what differs on this prompt",
        height=400,
        barmode="group",
        xaxis={"title": {"text": "block"}},
        yaxis={"title": {"text": "share of positions · total variation"}, "range": [0, 1.05]},
        yaxis2=right_axis("mean relative L2", tickformat=".2g"),
    )
