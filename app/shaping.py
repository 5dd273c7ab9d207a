"""Data shaping for the views: arrays and frames cut from a Trace, no plotting and no Streamlit.

Every function takes the trace (and a block) and returns plain numpy / pandas values the plots in
:mod:`app.plots` draw. Positions after a query (the future) come back as NaN, never as -inf.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import pandas as pd

from model.config import ModelArgs
from model.params import block_components, count_params
from tracing import nonfinite
from tracing.nonfinite import NonFinite
from tracing.tables import logit_lens_table, next_token_table
from tracing.trace import Trace

COMPONENT_LABELS = {
    "embedding": "token embedding",
    "attention": "MLA attention",
    "indexer": "lightning indexer",
    "block_norms": "block RMSNorms",
    "dense_mlp": "dense MLP",
    "router": "router",
    "routed_experts": "routed experts",
    "shared_experts": "shared experts",
    "final_norm": "final RMSNorm",
    "head": "output head",
}


# --- tokens -----------------------------------------------------------------------------------------------
def show_token(token: str, limit: int = 24, html_escape: bool = True) -> str:
    """A token as hover text: visible whitespace, HTML escaped (plotly renders some tags), shortened."""
    text = token.replace("\n", "⏎").replace("\t", "⇥").replace("\r", "␍")
    if text.startswith(" "):
        text = "␣" + text[1:]
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    text = text or "∅"
    return html.escape(text) if html_escape else text


def token_texts(trace: Trace) -> list[str]:
    return [show_token(t) for t in trace.tokens]


def position_labels(trace: Trace) -> list[str]:
    """Axis labels ``3 ␣truth`` (long tokens shortened; hovers show them in full elsewhere)."""
    return [f"{i} {show_token(t, limit=14)}" for i, t in enumerate(trace.tokens)]


def get(trace: Trace, name: str) -> np.ndarray | None:
    value = trace.tensors.get(name)
    return None if value is None else value.numpy()


def future_mask(n: int) -> np.ndarray:
    return np.triu(np.ones((n, n), dtype=bool), 1)


# --- the model map ------------------------------------------------------------------------------------------
@lru_cache(maxsize=8)
def _counts(args: ModelArgs) -> tuple[dict, list[dict[str, int]]]:
    return count_params(args), block_components(args)[1]


def block_params(args: ModelArgs, block: int) -> dict[str, int]:
    return _counts(args)[1][block]


@lru_cache(maxsize=8)
def params_by_block(args: ModelArgs) -> pd.DataFrame:
    """Parameters per block and component."""
    rows = [(b, c, n) for b in range(args.n_layers) for c, n in sorted(block_params(args, b).items())]
    return pd.DataFrame(rows, columns=["block", "component", "params"])


def param_counts(args: ModelArgs) -> dict:
    """Total and per-token activated parameters (model.params.count_params)."""
    return _counts(args)[0]


def params_table(args: ModelArgs) -> pd.DataFrame:
    """Per component: total parameters and those one token activates."""
    counts = param_counts(args)
    per_expert = counts["params_per_expert"]
    rows = []
    for name, total in counts["components"].items():
        if name == "embedding":
            active = 0
        elif name == "routed_experts":
            active = args.n_activated_experts * per_expert * args.n_moe_layers
        else:
            active = total
        rows.append({"component": COMPONENT_LABELS.get(name, name), "key": name, "total": total, "activated": active})
    frame = pd.DataFrame(rows)
    frame["share"] = frame["total"] / frame["total"].sum()
    return frame.sort_values("total", ascending=False, ignore_index=True)


# --- residual stream --------------------------------------------------------------------------------------
def stream(trace: Trace, block: int, where: str) -> np.ndarray | None:
    return get(trace, f"layers.{block}.{where}")


def embedded_stream(trace: Trace, max_dims: int = 256) -> tuple[np.ndarray, int] | None:
    """x_0 [T, min(d, max_dims)] and d."""
    x0 = get(trace, "layers.0.resid_pre")
    if x0 is None:
        return None
    return x0[:, :max_dims], x0.shape[1]


def block_updates(trace: Trace, block: int) -> pd.DataFrame | None:
    """Per position: |x_n|, |attention update|, |FFN update| (L2 norms)."""
    pre, mid, post = (stream(trace, block, w) for w in ("resid_pre", "resid_mid", "resid_post"))
    if pre is None or mid is None or post is None:
        return None
    return pd.DataFrame(
        {
            "position": np.arange(trace.n_tokens),
            "token": token_texts(trace),
            "stream": np.linalg.norm(pre, axis=-1),
            "attention update": np.linalg.norm(mid - pre, axis=-1),
            "FFN update": np.linalg.norm(post - mid, axis=-1),
        }
    )


def norm_rms(trace: Trace, block: int) -> pd.DataFrame | None:
    """Per position: the RMS that attn_norm and ffn_norm divide by."""
    pre, mid = stream(trace, block, "resid_pre"), stream(trace, block, "resid_mid")
    if pre is None:
        return None
    out = {"position": np.arange(trace.n_tokens), "token": token_texts(trace), "attn_norm input": _rms(pre)}
    if mid is not None:
        out["ffn_norm input"] = _rms(mid)
    return pd.DataFrame(out)


def _rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.square(x.astype(np.float64)), axis=-1))


@dataclass
class ResidualGrids:
    rows: list[str]  # "x_0 embedding", "after block 0", ...
    norm: np.ndarray  # [L+1, T]
    cos_rows: list[str]
    cos: np.ndarray  # [L, T] cosine(x_{n+1}, x_n)
    layers: list[int]
    attn: np.ndarray  # [L, T] |attention update|
    ffn: np.ndarray  # [L, T] |FFN update|


def residual_grids(frame: pd.DataFrame, n_tokens: int) -> ResidualGrids | None:
    """From tables()['residual']: norms, cosines and update sizes as layer × position grids."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["layer"].unique().tolist())

    def grid(column: str) -> np.ndarray:
        if column not in frame:
            return np.full((len(layers), n_tokens), np.nan)
        return frame.pivot(index="layer", columns="position", values=column).loc[layers].to_numpy()

    post = grid("norm_post")
    first = grid("norm_pre")[:1] if "norm_pre" in frame else np.full((1, n_tokens), np.nan)
    return ResidualGrids(
        rows=["x₀ (embedding)", *[f"after block {i}" for i in layers]],
        norm=np.vstack([first, post]),
        cos_rows=[f"block {i}" for i in layers],
        cos=grid("cos_prev"),
        layers=layers,
        attn=grid("attn_update_norm"),
        ffn=grid("ffn_update_norm"),
    )


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
    layers = sorted(frame["layer"].unique().tolist())
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


# --- attention and the indexer ---------------------------------------------------------------------------
def attention_pattern(trace: Trace, block: int, head: int | None = None) -> np.ndarray | None:
    """[T, S] attention probabilities after the sparse mask: mean over heads, or one head."""
    if head is not None:
        probs = get(trace, f"layers.{block}.attn.probs")
        if probs is None:
            return None
        z = probs[:, head, :].astype(np.float64)
    else:
        z = get(trace, f"layers.{block}.attn.probs_mean")
        if z is None:
            return None
        z = z.astype(np.float64)
    z = z.copy()
    z[future_mask(z.shape[0])] = np.nan
    return z


def recorded_heads(trace: Trace, block: int) -> int:
    probs = trace.tensors.get(f"layers.{block}.attn.probs")
    return 0 if probs is None else int(probs.shape[1])


def index_scores(trace: Trace, block: int) -> tuple[np.ndarray, np.ndarray] | None:
    """I [T, S] (NaN where masked) and the selection as a bool [T, S]."""
    scores = get(trace, f"layers.{block}.attn.indexer.scores")
    if scores is None:
        return None
    z = scores.astype(np.float64)
    z[~np.isfinite(z)] = np.nan
    return z, selected_keys(trace, block)


def selected_keys(trace: Trace, block: int) -> np.ndarray:
    n = trace.n_tokens
    chosen = np.zeros((n, n + 1), dtype=bool)
    topk = get(trace, f"layers.{block}.attn.indexer.topk_indices")
    if topk is not None:
        slot = np.where(topk < 0, n, topk)
        chosen[np.repeat(np.arange(n), topk.shape[1]), slot.ravel()] = True
    return chosen[:, :n] & ~future_mask(n)


MASK_NAMES = ("future (causal mask)", "visible, not selected (−∞)", "selected (0)")


def mask_categories(trace: Trace, block: int) -> np.ndarray | None:
    """[T, S]: 0 future, 1 visible but dropped by the indexer, 2 selected."""
    if f"layers.{block}.attn.indexer.topk_indices" not in trace:
        return None
    n = trace.n_tokens
    grid = np.ones((n, n), dtype=np.int64)
    grid[future_mask(n)] = 0
    grid[selected_keys(trace, block)] = 2
    return grid


def recall_grid(frame: pd.DataFrame | None, n_tokens: int) -> tuple[list[int], np.ndarray] | None:
    """From tables()['indexer_recall']: layers and recall [L, T]."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["layer"].unique().tolist())
    return layers, frame.pivot(index="layer", columns="query", values="recall").loc[layers].to_numpy()


def query_profile(trace: Trace, block: int, query: int) -> pd.DataFrame | None:
    """For one query: per visible key, the index score, whether selected, and the attention probability."""
    got = index_scores(trace, block)
    if got is None:
        return None
    scores, chosen = got
    keys = np.arange(query + 1)
    out = pd.DataFrame(
        {
            "key": keys,
            "token": [token_texts(trace)[k] for k in keys],
            "index score": scores[query, keys],
            "selected": chosen[query, keys],
        }
    )
    probs = attention_pattern(trace, block)
    if probs is not None:
        out["attention"] = probs[query, keys]
    return out


# --- health ----------------------------------------------------------------------------------------------
def first_nonfinite(trace: Trace) -> NonFinite | None:
    return nonfinite.first_nonfinite(trace.tensors, trace.config, trace.n_tokens)


# --- the router -------------------------------------------------------------------------------------------
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
    idx = get(trace, f"layers.{block}.ffn.gate.topk_indices")
    if idx is None:
        return None
    cfg = trace.config
    n, e = trace.n_tokens, cfg.n_routed_experts
    rows = np.repeat(np.arange(n), idx.shape[1])
    selected = np.zeros((n, e), dtype=bool)
    selected[rows, idx.ravel()] = True
    rank = np.full((n, e), -1, dtype=np.int64)
    rank[rows, idx.ravel()] = np.tile(np.arange(idx.shape[1]), n)
    weight = np.zeros((n, e), dtype=np.float64)
    w = get(trace, f"layers.{block}.ffn.gate.topk_weights")
    if w is not None:
        weight[rows, idx.ravel()] = w.ravel()
    groups = get(trace, f"layers.{block}.ffn.gate.groups")
    chosen = None
    if groups is not None:
        chosen = np.zeros((n, cfg.n_expert_groups), dtype=bool)
        chosen[np.repeat(np.arange(n), groups.shape[1]), groups.ravel()] = True
    return Routing(
        block,
        get(trace, f"layers.{block}.ffn.gate.scores"),
        get(trace, f"layers.{block}.ffn.gate.biased_scores"),
        selected,
        weight,
        rank,
        get(trace, f"layers.{block}.ffn.gate.group_scores"),
        chosen,
    )


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest along the last axis, best first, lower index first among ties
    (the model's ``ops.topk`` order)."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def route(scores: np.ndarray, cfg: ModelArgs, group_top2: bool = True) -> np.ndarray:
    """The router's selection from the scores it ranks: group-limited top-k, as ``Gate.forward``."""
    n, e = scores.shape
    x = scores.astype(np.float64)
    if cfg.n_expert_groups > 1:
        grouped = x.reshape(n, cfg.n_expert_groups, e // cfg.n_expert_groups)
        if group_top2:
            group_scores = np.take_along_axis(grouped, _top(grouped, 2), -1).sum(-1)
        else:
            group_scores = grouped.max(-1)
        keep = np.zeros((n, cfg.n_expert_groups), dtype=bool)
        np.put_along_axis(keep, _top(group_scores, cfg.n_limited_groups), True, -1)
        x = np.where(np.repeat(keep, e // cfg.n_expert_groups, axis=1), x, -np.inf)
    return _top(x, cfg.n_activated_experts)


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
    recorded = get(trace, f"layers.{block}.ffn.gate.topk_indices")
    top2 = cfg.has_gate_bias
    again = route(r.biased, cfg, top2)
    without = route(r.scores, cfg, top2)
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


def expert_weights(trace: Trace, block: int) -> pd.DataFrame | None:
    """Long frame: per position and chosen expert, its weight and rank."""
    idx = get(trace, f"layers.{block}.ffn.gate.topk_indices")
    if idx is None:
        return None
    w = get(trace, f"layers.{block}.ffn.gate.topk_weights")
    n, k = idx.shape
    per_group = trace.config.experts_per_group
    tokens = token_texts(trace)
    return pd.DataFrame(
        {
            "position": np.repeat(np.arange(n), k),
            "token": np.repeat(np.asarray(tokens, dtype=object), k),
            "expert": idx.ravel(),
            "group": idx.ravel() // per_group,
            "rank": np.tile(np.arange(k), n),
            "weight": w.ravel() if w is not None else np.full(n * k, np.nan),
        }
    )


def routed_shared(trace: Trace, block: int) -> pd.DataFrame | None:
    routed = get(trace, f"layers.{block}.ffn.routed_out")
    shared = get(trace, f"layers.{block}.ffn.shared_out")
    if routed is None or shared is None:
        return None
    return pd.DataFrame(
        {
            "position": np.arange(trace.n_tokens),
            "token": token_texts(trace),
            "routed experts": np.linalg.norm(routed, axis=-1),
            "shared expert": np.linalg.norm(shared, axis=-1),
        }
    )


def load_grid(frame: pd.DataFrame | None) -> tuple[list[int], np.ndarray, np.ndarray | None] | None:
    """From tables()['expert_load']: MoE blocks, tokens per expert [L, E], mean weight [L, E]."""
    if frame is None or frame.empty:
        return None
    layers = sorted(frame["layer"].unique().tolist())
    counts = frame.pivot(index="layer", columns="expert", values="tokens").loc[layers].to_numpy()
    weights = (
        frame.pivot(index="layer", columns="expert", values="mean_weight").loc[layers].to_numpy()
        if "mean_weight" in frame
        else None
    )
    return layers, counts, weights


# --- interventions: a baseline and an intervened trace of one prompt ---------------------------------------
def expert_tokens(trace: Trace, block: int) -> np.ndarray | None:
    """Tokens routed to each expert of a MoE block [E]."""
    idx = get(trace, f"layers.{block}.ffn.gate.topk_indices")
    if idx is None:
        return None
    return np.bincount(idx[idx >= 0].ravel(), minlength=trace.config.n_routed_experts)


def busiest_experts(trace: Trace, block: int, n: int = 5) -> list[tuple[int, int]]:
    """The ``n`` experts of a block that received the most tokens, busiest first: (expert, tokens)."""
    counts = expert_tokens(trace, block)
    if counts is None:
        return []
    order = np.argsort(-counts, kind="stable")[:n]
    return [(int(e), int(counts[e])) for e in order if counts[e] > 0]


_DRIFT_SITES = {"resid_pre": "in", "resid_mid": "after attention", "resid_post": "out"}


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
    have = set(zip(stream["layer"], stream["site"], strict=True))
    rows, rel, cos = [], [], []
    for (layer, site), part in stream.groupby(["layer", "site"], sort=False):
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
    out = pd.DataFrame({"layer": np.arange(n_layers)}).set_index("layer")
    stream = tables.get("stream")
    if stream is not None:
        post = stream[stream["site"] == "resid_post"].groupby("layer")["rel_l2"]
        out["max_rel_l2"], out["mean_rel_l2"] = post.max(), post.mean()
    for name, column in (("experts", "experts_changed"), ("indexer_keys", "keys_changed"), ("predictions", "top1_changed")):
        frame = tables.get(name)
        if frame is not None:
            out[column] = frame.groupby("layer")["changed"].sum()
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
    layers = sorted(predictions["layer"].unique().tolist())
    frame = predictions.sort_values(["layer", "position"])
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
