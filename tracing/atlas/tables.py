"""The atlas's tables, from its totals (tracing.atlas.counts): one tidy DataFrame per table.

Computed once the totals are complete (after every rank's are added), so ratios such as PMI and
the sinks' rates are of the whole corpus. docs/atlas.md describes every column.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import pandas as pd
import torch

from model.config import ModelArgs

from .counts import FIXED, RECALL_BINS, distance_bins, far_pairs, sink_bins

TOP_TOKENS = 20  # most specific tokens kept per expert
PRIOR = 10.0  # the specificity's prior, in occurrences of a token that choose the expert at its average rate
TOP_SINKS = 20  # key positions, and tokens, kept per block
TOP_EXPERTS = 16  # experts kept per block and token in token_experts (k = 8 on the 671B model)
TOP_LISTED = 5  # most specific tokens listed per expert in the experts table
QUANTILES = {"p10": 0.10, "p50": 0.50, "p90": 0.90}

# the tables and their columns, in order: the on-disk contract (docs/atlas.md)
COLUMNS = {
    "expert_load": ("block", "expert", "count", "weight_sum", "share"),
    "expert_pairs": ("block", "expert_a", "expert_b", "count"),
    "expert_tokens": ("block", "expert", "token_id", "token", "count", "pmi", "specificity"),
    "group_load": ("block", "group", "count"),
    "bias_effect": ("block", "tokens", "tokens_changed", "selections_changed"),
    "indexer_distance": ("block", "distance_bin", "count"),
    "indexer_recall": ("block", "queries", "p10", "p50", "p90", "mean"),
    "indexer_sinks": ("block", "position", "token_id", "token", "selected", "visible", "rate", "expected", "lift"),
    "token_experts": ("block", "token_id", "token", "occurrences", "expert", "count", "share", "specificity"),
    "block_measures": (
        "block",
        "overlap_queries",
        "overlap_prev",
        "routings",
        "near_ties",
        "near_tie_share",
        "group_near_ties",
        "group_near_tie_share",
    ),
}
OPTIONAL = ("token_experts", "block_measures")  # tables an atlas of an earlier run lacks: read_atlas reads it without them
EXPERTS_COLUMNS = ("block", "expert", "count", "share", "mean_weight", "top_tokens")

TokenStrings = Callable[[list[int]], list[str]]


def _frame(name: str, rows: list[dict]) -> pd.DataFrame:
    frame = pd.DataFrame(rows, columns=list(COLUMNS[name]))
    return frame.astype({c: "int64" for c in COLUMNS[name] if c in ("block", "count") and not frame.empty})


def tables(state: dict[str, torch.Tensor], args: ModelArgs, names: TokenStrings, min_count: int) -> dict[str, pd.DataFrame]:
    """Every table of the atlas from complete totals; ``names`` gives token ids their strings."""
    s = {name: value.numpy() for name, value in state.items()}
    moe = list(range(args.n_dense_layers, args.n_layers))
    out = {
        "expert_load": _expert_load(s, moe, args),
        "expert_pairs": _expert_pairs(s, moe, args.n_routed_experts),
        "expert_tokens": _expert_tokens(s, moe, args, names, min_count),
        "group_load": _group_load(s, moe),
        "bias_effect": _bias_effect(s, moe),
        "indexer_distance": _distance(s),
        "indexer_recall": _recall(s),
        "indexer_sinks": _sinks(s, names, args.index_topk, min_count),
        "token_experts": _token_experts(s, moe, args, names, min_count),
        "block_measures": _block_measures(s, moe, args),
    }
    return out


def imbalance(load: pd.DataFrame) -> dict[str, dict]:
    """Per MoE block: busiest expert over the mean load, coefficient of variation (population
    standard deviation over the mean) and the number of experts never chosen."""
    out = {}
    for block, rows in load.groupby("block"):
        counts = rows["count"].to_numpy(dtype=np.float64)
        mean = counts.mean()
        out[str(block)] = {
            "max_over_mean": float(counts.max() / mean) if mean else None,
            "cv": float(counts.std() / mean) if mean else None,
            "never_chosen": int((counts == 0).sum()),
        }
    return out


def _expert_load(s, moe: list[int], args: ModelArgs) -> pd.DataFrame:
    e, k = args.n_routed_experts, args.n_activated_experts
    frames = []
    for m, block in enumerate(moe):
        count = s["expert_count"][m]
        share = count / max(int(s["tokens"][0]) * k, 1)
        frame = {"block": block, "expert": np.arange(e), "count": count, "weight_sum": s["weight_sum"][m] / FIXED, "share": share}
        frames.append(pd.DataFrame(frame))
    return _concat("expert_load", frames)


def _expert_pairs(s, moe: list[int], e: int) -> pd.DataFrame:
    frames = []
    for m, block in enumerate(moe):
        keys = np.flatnonzero(s["pair_count"][m])
        frames.append(
            pd.DataFrame({"block": block, "expert_a": keys // e, "expert_b": keys % e, "count": s["pair_count"][m][keys]})
        )
    return _concat("expert_pairs", frames)


def _expert_tokens(s, moe: list[int], args: ModelArgs, names: TokenStrings, min_count: int) -> pd.DataFrame:
    """PMI(expert, token) = log2 P(expert | token) / P(expert): how much more often the token's
    occurrences choose the expert than tokens do on average. A token that always chooses the expert
    has log2 1/P(expert) whatever its count, so PMI ties rare and common tokens; the ranking is by
    ``specificity``, the PMI of counts with PRIOR occurrences added at the expert's average rate:
    log2 ((count + PRIOR P(e)) / ((n_token + PRIOR) P(e))), which grows with the evidence. The
    TOP_TOKENS highest per expert among pairs counted at least ``min_count`` times."""
    e, v = args.n_routed_experts, args.vocab_size
    keys, counts = s["expert_token_keys"], s["expert_token_counts"]
    if not len(keys):
        return _frame("expert_tokens", [])
    slot, token = keys // v, keys % v
    m, expert = slot // e, slot % e
    tokens = max(int(s["tokens"][0]), 1)
    load = s["expert_count"][m, expert].astype(np.float64)
    occurrences = s["token_count"][token].astype(np.float64)
    pmi = np.log2(counts.astype(np.float64) * tokens / (load * occurrences))
    frame = pd.DataFrame({"block": np.asarray(moe)[m], "expert": expert, "token_id": token, "count": counts})
    frame["pmi"], frame["specificity"] = pmi, specificity(counts, occurrences, load, tokens)
    frame = frame[frame["count"] >= min_count]
    order = ["block", "expert", "specificity", "count", "token_id"]
    frame = frame.sort_values(order, ascending=[True, True, False, False, True])
    frame = frame.groupby(["block", "expert"], sort=False).head(TOP_TOKENS).reset_index(drop=True)
    frame.insert(3, "token", _strings(names, frame["token_id"].to_numpy()))
    return frame[list(COLUMNS["expert_tokens"])]


def specificity(count: np.ndarray, occurrences: np.ndarray, load: np.ndarray, tokens: int) -> np.ndarray:
    """PMI with a count prior: log2 ((count + PRIOR P(e)) / ((occurrences + PRIOR) P(e))), P(e) =
    load / tokens, the share of tokens that choose the expert: PRIOR occurrences added at the
    expert's average rate, so that a rare token does not tie with a common one."""
    rate = np.asarray(load, dtype=np.float64) / max(tokens, 1)
    return np.log2((np.asarray(count, dtype=np.float64) + PRIOR * rate) / ((np.asarray(occurrences) + PRIOR) * rate))


def _token_experts(s, moe: list[int], args: ModelArgs, names: TokenStrings, min_count: int) -> pd.DataFrame:
    """The other way round from expert_tokens: per MoE block and token seen at least ``min_count``
    times, the experts its occurrences chose (the TOP_EXPERTS most chosen; ties: the lower expert),
    so that a token can be looked up. ``share`` = count / (occurrences x k), the expert's share of the
    token's routings in the block (over all its experts they add up to 1)."""
    e, v, k = args.n_routed_experts, args.vocab_size, args.n_activated_experts
    keys, counts = s["expert_token_keys"], s["expert_token_counts"]
    if not len(keys):
        return _frame("token_experts", [])
    slot, token = keys // v, keys % v
    m, expert = slot // e, slot % e
    occurrences = s["token_count"][token]
    frame = pd.DataFrame({"block": np.asarray(moe)[m], "token_id": token, "occurrences": occurrences, "expert": expert})
    frame["count"] = counts
    frame["share"] = counts / (occurrences * k)
    frame["specificity"] = specificity(counts, occurrences, s["expert_count"][m, expert], int(s["tokens"][0]))
    frame = frame[occurrences >= min_count]
    frame = frame.sort_values(["block", "token_id", "count", "expert"], ascending=[True, True, False, True])
    frame = frame.groupby(["block", "token_id"], sort=False).head(TOP_EXPERTS).reset_index(drop=True)
    frame.insert(2, "token", _strings(names, frame["token_id"].to_numpy()))
    return frame[list(COLUMNS["token_experts"])]


def experts_table(found: Mapping[str, pd.DataFrame], top: int = TOP_LISTED) -> pd.DataFrame:
    """One row per MoE block and routed expert, every block at once, to browse: its load (``count``,
    ``share``), ``mean_weight`` (weight_sum / count; NaN for an expert never chosen) and its ``top``
    most specific tokens (``top_tokens``, ``top_token_ids``: lists, most specific first), from an
    atlas's tables (``read_atlas(...).tables``). Ordered by block, then expert."""
    load = found["expert_load"].sort_values(["block", "expert"], ignore_index=True)
    specific = found["expert_tokens"].sort_values(
        ["block", "expert", "specificity", "count", "token_id"], ascending=[True, True, False, False, True]
    )
    specific = specific.groupby(["block", "expert"], sort=False).head(top)
    lists = specific.groupby(["block", "expert"], sort=False).agg(top_tokens=("token", list), top_token_ids=("token_id", list))
    frame = load.join(lists, on=["block", "expert"])
    for column in ("top_tokens", "top_token_ids"):
        frame[column] = frame[column].map(lambda x: x if isinstance(x, list) else [])
    frame["mean_weight"] = frame["weight_sum"] / frame["count"].where(frame["count"] > 0)
    return frame[list(EXPERTS_COLUMNS) + ["top_token_ids"]]


def search_experts(frame: pd.DataFrame, text: str) -> pd.DataFrame:
    """The rows of :func:`experts_table` that ``text`` names: a number matches the block or the expert,
    and any text matches a most specific token that holds it (case-insensitive); empty: every row."""
    text = text.strip()
    if not text:
        return frame
    needle = text.casefold()
    hit = frame["top_tokens"].map(lambda tokens: any(needle in t.casefold() for t in tokens))
    if text.isascii() and text.isdigit():
        hit |= (frame["block"] == int(text)) | (frame["expert"] == int(text))
    return frame[hit]


def find_token(found: Mapping[str, pd.DataFrame], text: str) -> int | None:
    """The id of the token ``text`` names in an atlas: digits are an id, any other text a token's
    exact string (as the tokenizer writes it, a leading space included). None: the atlas lists no such
    token (too rare for ``--min-count``, never seen, or an atlas without token_experts)."""
    table = found.get("token_experts")
    if table is None or table.empty:
        return None
    if text.isascii() and text.isdigit():  # " 12" is a token's text, a leading space included
        token = int(text)
        return token if (table["token_id"] == token).any() else None
    hits = table.loc[table["token"] == text, "token_id"]
    return int(hits.iloc[0]) if len(hits) else None


def token_routes(found: Mapping[str, pd.DataFrame], token: int) -> pd.DataFrame:
    """Per MoE block, the experts that took ``token`` in the atlas's corpus: count, share of the
    token's routings in the block, specificity; most chosen first in each block."""
    table = found["token_experts"]
    rows = table[table["token_id"] == token]
    return rows.sort_values(["block", "count", "expert"], ascending=[True, False, True], ignore_index=True)


def _group_load(s, moe: list[int]) -> pd.DataFrame:
    counts = s["group_count"]
    frames = [
        pd.DataFrame({"block": block, "group": np.arange(counts.shape[1]), "count": counts[m]}) for m, block in enumerate(moe)
    ]
    return _concat("group_load", frames)


def _bias_effect(s, moe: list[int]) -> pd.DataFrame:
    tokens = int(s["tokens"][0])
    rows = [
        {
            "block": block,
            "tokens": tokens,
            "tokens_changed": int(s["bias_tokens"][m]),
            "selections_changed": int(s["bias_selections"][m]),
        }
        for m, block in enumerate(moe)
    ]
    return _frame("bias_effect", rows)


def _block_measures(s, moe: list[int], args: ModelArgs) -> pd.DataFrame:
    """Per block: the mean overlap of the indexer's selection with the block before's, over the
    queries that see more than index_topk keys (NaN in block 0 and with none), and per MoE block the
    share of routings (one per token) whose margin, and whose group margin, is a near-tie (NaN in a
    dense block; the group share also where every group is chosen or there is one group)."""
    tokens, grouped = int(s["tokens"][0]), args.n_limited_groups < args.n_expert_groups  # else no group is left out
    rows = []
    for block in range(args.n_layers):
        n = int(s["overlap_queries"][block])
        row = {"block": block, "overlap_queries": n, "overlap_prev": s["overlap_sum"][block] / FIXED / n if n else np.nan}
        m = moe.index(block) if block in moe else None
        routings = tokens if m is not None else 0
        ties = int(s["near_ties"][m]) if m is not None else 0
        group_ties = int(s["group_near_ties"][m]) if m is not None else 0
        row.update(routings=routings, near_ties=ties, near_tie_share=ties / routings if routings else np.nan)
        row.update(group_near_ties=group_ties, group_near_tie_share=group_ties / routings if routings and grouped else np.nan)
        rows.append(row)
    frame = _frame("block_measures", rows)
    return frame.astype({c: "int64" for c in ("overlap_queries", "routings", "near_ties", "group_near_ties")})


def _distance(s) -> pd.DataFrame:
    """Selected keys by floor(log2(query position - key position)): distance_bin b holds the
    distances 2^b .. 2^(b+1) - 1, bin -1 the query's own position; every bin up to the longest."""
    counts = s["distance"]  # (L, seq_len): by exact distance
    lo, hi = distance_bins(counts.shape[1])
    per_bin = _by_bin(counts, lo, hi)  # (L, bins)
    frames = [
        pd.DataFrame({"block": block, "distance_bin": np.arange(len(lo)) - 1, "count": per_bin[block]})
        for block in range(counts.shape[0])
    ]
    return _concat("indexer_distance", frames)


def _by_bin(counts: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Sums of counts (..., distance) over the distance bins lo .. hi."""
    prefix = np.concatenate([np.zeros((*counts.shape[:-1], 1), dtype=np.int64), np.cumsum(counts, axis=-1)], axis=-1)
    return prefix[..., hi + 1] - prefix[..., lo]


def _recall(s) -> pd.DataFrame:
    """Quantiles by the inverted CDF (the value at rank ceil(p n) of n), as the midpoint of its bin."""
    rows = []
    for block, hist in enumerate(s["recall_hist"]):
        n = int(s["recall_queries"][block])
        row = {"block": block, "queries": n, "mean": s["recall_sum"][block] / FIXED / n if n else np.nan}
        cumulative = np.cumsum(hist)
        for name, p in QUANTILES.items():
            rank = max(int(np.ceil(p * n)), 1)
            row[name] = (np.searchsorted(cumulative, rank) + 0.5) / RECALL_BINS if n else np.nan
        rows.append(row)
    return _frame("indexer_recall", rows)


def _sinks(s, names: TokenStrings, first: int, min_count: int) -> pd.DataFrame:
    """Keys the indexer picks from afar (a query at least index_topk positions later) more often
    than their distances predict. Per block: ``selected`` picks from afar, ``visible`` pairs from
    afar, ``rate`` = selected / visible, ``expected`` = the picks the key would get at the block's
    rate of picks from afar at each of its distances (tracing.atlas.counts.sink_bins: so late
    positions, seen only from just past index_topk where picks are common, are not mistaken for
    sinks), ``lift`` = selected / expected
    (over all keys, selected and expected add up alike). The TOP_SINKS key positions (token_id -1)
    and the TOP_SINKS tokens (position -1, seen at least ``min_count`` times), each visible at
    least ``min_count`` times, with the highest lift."""
    pairs = far_pairs(s["length_count"], first)  # (P, bins): every position's pairs from afar
    lo, hi = sink_bins(pairs.shape[0])
    per_bin = _by_bin(s["distance"] * (np.arange(pairs.shape[0]) >= first), lo, hi)  # (L, bins): picks from afar
    rate = per_bin / np.maximum(pairs.sum(axis=0), 1)  # (L, bins)
    tokens = s["sink_token_visible"]  # (V, bins)
    frequent = s["token_count"] >= min_count
    frames = []
    for block in range(per_bin.shape[0]):
        kinds = (
            ("position", pairs, s["sink_position_selected"][block], np.ones(pairs.shape[0], dtype=bool)),
            ("token_id", tokens, s["sink_token_selected"][block], frequent),
        )
        for key, visible_by_bin, selected, allowed in kinds:
            visible = visible_by_bin.sum(axis=1)
            keep = np.flatnonzero(allowed & (visible >= min_count))
            frame = pd.DataFrame({key: keep, "selected": selected[keep], "visible": visible[keep]})
            frame["rate"] = frame["selected"] / frame["visible"]
            frame["expected"] = visible_by_bin[keep] @ rate[block]
            frame["lift"] = frame["selected"] / frame["expected"].where(frame["expected"] > 0)
            frame = frame.sort_values(["lift", "selected", key], ascending=[False, False, True], na_position="last")
            frames.append(frame.head(TOP_SINKS).assign(block=block, token=""))
    out = _concat("indexer_sinks", frames)
    out["position"] = out["position"].fillna(-1).astype(np.int64)
    out["token_id"] = out["token_id"].fillna(-1).astype(np.int64)
    named = out["token_id"] >= 0
    out.loc[named, "token"] = _strings(names, out.loc[named, "token_id"].to_numpy())
    return out


def _strings(names: TokenStrings, ids: np.ndarray) -> list[str]:
    unique = sorted(set(ids.tolist()))
    lookup = dict(zip(unique, names(unique), strict=True))
    return [lookup[i] for i in ids.tolist()]


def _concat(name: str, frames: list[pd.DataFrame]) -> pd.DataFrame:
    if not frames:
        return _frame(name, [])
    return pd.concat(frames, ignore_index=True)[list(COLUMNS[name])]
