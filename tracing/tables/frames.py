"""Tidy tables of a Trace (one row per observation), the one place tables are built.

Every view of the app and every CSV/Parquet export reads these. A table exists only when the
trace holds the sites it needs.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..analyses.margins import NEAR_TIE
from ..analyses.mtp import drafted, verified
from ..sites import SAVED, layer_site, part_name, site_order
from ..trace import Trace
from .grid import index_grid

# OWASP CSV injection: cells starting with these are formulas to a spreadsheet


def _positions(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(trace.n_tokens), np.asarray(trace.tokens, dtype=object)


def phases(trace: Trace) -> np.ndarray:
    """Per position, the code path that ran it: ``prefill`` (MHA over the prompt) or ``decode`` (one
    position at a time over the caches: after ``--prefill N``, and every generated token)."""
    n = trace.n_tokens
    start = min(trace.extra.get("prefill", n), trace.extra.get("generation", {}).get("start", n))
    return np.where(np.arange(n) < start, "prefill", "decode").astype(object)


def generated(trace: Trace) -> np.ndarray:
    """Per position, whether the model chose the token (a generation) rather than the prompt."""
    return np.arange(trace.n_tokens) >= trace.extra.get("generation", {}).get("start", trace.n_tokens)


def tokens_table(trace: Trace) -> pd.DataFrame:
    pos, tok = _positions(trace)
    frame = {"position": pos, "token_id": np.asarray(trace.token_ids), "token": tok, "phase": phases(trace)}
    return pd.DataFrame({**frame, "generated": generated(trace)})


def steps_table(trace: Trace) -> pd.DataFrame:
    """Per position: its token, the probability the position before gave it, that distribution's
    entropy and its top alternatives (what the model almost wrote there), and the code path."""
    if "next.topk_indices" not in trace:
        return pd.DataFrame()
    pos, tok = _positions(trace)
    top, probs = trace["next.topk_indices"].numpy(), trace["next.topk_probs"].numpy()  # (T, A): for position + 1
    frame: dict = {"position": pos, "phase": phases(trace), "generated": generated(trace)}
    frame.update(token_id=np.asarray(trace.token_ids), token=tok)
    before = np.full(trace.n_tokens, np.nan)  # the position before each one's distribution
    if "next.token_prob" in trace:
        before[1:] = trace["next.token_prob"].numpy()[:-1]
    frame["chosen_prob"] = before
    if "next.entropy" in trace:
        entropy = np.full(trace.n_tokens, np.nan)
        entropy[1:] = trace["next.entropy"].numpy()[:-1]
        frame["entropy"] = entropy
    for rank in range(top.shape[1]):
        ids = np.full(trace.n_tokens, -1)
        ids[1:] = top[:-1, rank]
        p = np.full(trace.n_tokens, np.nan)
        p[1:] = probs[:-1, rank]
        frame[f"alt{rank + 1}"] = np.asarray(["" if i < 0 else name for i, name in zip(ids, _names(trace, ids), strict=True)])
        frame[f"alt{rank + 1}_prob"] = p
    if "mtp.topk_indices" in trace:  # the MTP module's draft of this token, made at the position two before
        probs = trace["mtp.topk_probs"].numpy() if "mtp.topk_probs" in trace else None
        ids, p = drafted(trace["mtp.topk_indices"].numpy(), probs)
        frame["mtp_draft"] = np.asarray(["" if i < 0 else name for i, name in zip(ids, _names(trace, ids), strict=True)])
        frame["mtp_draft_id"] = ids
        frame["mtp_draft_prob"] = p
        chosen = np.asarray(trace.token_ids)
        frame["mtp_accepted"] = pd.array(
            [None if i < 0 else bool(i == t) for i, t in zip(ids, chosen, strict=True)], dtype="boolean"
        )
        frame["mtp_verified"] = verified(trace.n_tokens, trace.extra.get("generation", {}).get("start"))
    return pd.DataFrame(frame)


def residual_table(trace: Trace) -> pd.DataFrame:
    """Per block and position: stream norms before, between and after, the update sizes, and the
    cosine between this block's output and the previous block's (the embedding for block 0)."""
    pos, tok = _positions(trace)
    frames = []
    prev = None
    for i in trace.layers_with("resid_post"):
        post = trace.site(i, "resid_post").double()
        pre = trace.site(i, "resid_pre")
        mid = trace.site(i, "resid_mid")
        base = prev if prev is not None else (pre.double() if pre is not None else None)
        row = {"block": i, "position": pos, "token": tok, "norm_post": post.norm(dim=-1).numpy()}
        if pre is not None:
            row["norm_pre"] = pre.double().norm(dim=-1).numpy()
        if mid is not None:
            row["norm_mid"] = mid.double().norm(dim=-1).numpy()
            row["ffn_update_norm"] = (post - mid.double()).norm(dim=-1).numpy()
            if pre is not None:
                row["attn_update_norm"] = (mid.double() - pre.double()).norm(dim=-1).numpy()
        if base is not None:
            row["cos_prev"] = torch.nn.functional.cosine_similarity(post, base, dim=-1).numpy()
        frames.append(pd.DataFrame(row))
        prev = post
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def router_table(trace: Trace) -> pd.DataFrame:
    """Per MoE block, position and expert: score, biased score, whether chosen, its rank and weight.
    A block whose scores are not recorded has rows for its chosen experts only: every expert's row
    would say no more than "not chosen", and T x E rows from T x k indices would let a small file
    (claiming thousands of experts) cost gigabytes."""
    cfg = trace.config
    per_group = cfg.n_routed_experts // cfg.n_expert_groups
    e = cfg.n_routed_experts
    _, tok = _positions(trace)
    frames = []
    for i in trace.layers_with("ffn.gate.topk_indices"):
        idx = trace.site(i, "ffn.gate.topk_indices").numpy()  # (T, k)
        scores = {c: trace.site(i, f"ffn.gate.{s}") for s, c in (("scores", "score"), ("biased_scores", "biased_score"))}
        scored = any(v is not None for v in scores.values())
        t, x, rank = _router_rows(idx, e, scored)
        w = trace.site(i, "ffn.gate.topk_weights")
        weight = np.zeros(len(t), dtype=np.float32) if w is None else np.where(rank >= 0, w.numpy()[t, rank.clip(0)], 0)
        data = {"block": i, "position": t, "token": tok[t], "expert": x, "group": x // per_group}
        for column, value in scores.items():
            if value is not None:
                data[column] = value.numpy()[t, x]
        groups = trace.site(i, "ffn.gate.groups")
        if groups is not None:
            chosen = index_grid(groups.numpy(), cfg.n_expert_groups)  # (T, G)
            data["group_chosen"] = chosen[t, x // per_group]
        data["selected"] = rank >= 0
        data["rank"] = rank
        data["weight"] = weight.astype(np.float32)
        frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _router_rows(idx: np.ndarray, e: int, every: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The router table's rows, position by position and expert by expert: (position, expert, the
    choice's rank or -1), for every expert or only the chosen."""
    n, k = idx.shape
    if every:
        rank = index_grid(idx, e, np.arange(k), -1, np.int64)  # (T, E)
        return np.repeat(np.arange(n), e), np.tile(np.arange(e), n), rank.ravel()
    order = np.argsort(idx, axis=1, kind="stable")  # (T, k): the choices by expert id
    return np.repeat(np.arange(n), k), np.take_along_axis(idx, order, axis=1).ravel(), order.ravel()


def expert_load_table(trace: Trace) -> pd.DataFrame:
    """Per MoE block and expert: tokens routed to it, share of all routings, mean gating weight."""
    cfg = trace.config
    per_group = cfg.n_routed_experts // cfg.n_expert_groups
    frames = []
    for i in trace.layers_with("ffn.gate.topk_indices"):
        idx = trace.site(i, "ffn.gate.topk_indices").numpy().ravel()
        counts = np.bincount(idx, minlength=cfg.n_routed_experts)
        data = {
            "block": i,
            "expert": np.arange(cfg.n_routed_experts),
            "group": np.arange(cfg.n_routed_experts) // per_group,
            "count": counts,
            "share": counts / max(len(idx), 1),
        }
        if trace.site(i, "ffn.gate.topk_weights") is not None:
            w = trace.site(i, "ffn.gate.topk_weights").numpy().ravel()
            sums = np.bincount(idx, weights=w, minlength=cfg.n_routed_experts)
            data["mean_weight"] = np.divide(sums, counts, out=np.zeros_like(sums), where=counts > 0)
        frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def groups_table(trace: Trace) -> pd.DataFrame:
    """Per MoE block, position and expert group: the group score and whether it was chosen."""
    cfg = trace.config
    pos, tok = _positions(trace)
    n, g = trace.n_tokens, cfg.n_expert_groups
    frames = []
    for i in trace.layers_with("ffn.gate.group_scores"):
        groups = trace.site(i, "ffn.gate.groups")
        chosen = np.zeros((n, g), dtype=bool) if groups is None else index_grid(groups.numpy(), g)  # (T, G)
        frames.append(
            pd.DataFrame(
                {
                    "block": i,
                    "position": np.repeat(pos, g),
                    "token": np.repeat(tok, g),
                    "group": np.tile(np.arange(g), n),
                    "group_score": trace.site(i, "ffn.gate.group_scores").numpy().ravel(),
                    "chosen": chosen.ravel(),
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def indexer_table(trace: Trace) -> pd.DataFrame:
    """Per block, query and visible key: index score, whether selected and its rank, and the
    attention probability (mean over heads) when recorded."""
    n = trace.n_tokens
    pos, tok = _positions(trace)
    blocks = trace.layers_with("attn.indexer.scores")
    if not blocks:  # the pairs cost T^2 / 2: only for scores the file holds (as many)
        return pd.DataFrame()
    q, k = np.tril_indices(n)  # visible (query, key) pairs, row by row
    frames = []
    for i in blocks:
        data = {
            "block": i,
            "query": q,
            "query_token": tok[q],
            "key": k,
            "key_token": tok[k],
            "score": trace.site(i, "attn.indexer.scores").numpy()[q, k],
        }
        if trace.site(i, "attn.indexer.topk_indices") is not None:
            topk = trace.site(i, "attn.indexer.topk_indices").numpy()
            rank = index_grid(topk, n, np.arange(topk.shape[1]), -1, np.int64)  # (T, S)
            data["selected"] = rank[q, k] >= 0
            data["rank"] = rank[q, k]
        if trace.site(i, "attn.probs_mean") is not None:
            data["attn_prob"] = trace.site(i, "attn.probs_mean").numpy()[q, k]
        frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def recall_table(trace: Trace) -> pd.DataFrame:
    """Per block and query: the share of the dense attention mass the selected keys cover, and where
    recorded the KL divergence of the indexer's distribution from the dense one (``kl``, nats) and
    the overlap of the selected keys with the block before's (``overlap_prev``; NaN in block 0)."""
    pos, tok = _positions(trace)
    frames = []
    for i in trace.layers_with("attn.indexer.recall"):
        frame = pd.DataFrame({"block": i, "query": pos, "token": tok, "recall": trace.site(i, "attn.indexer.recall").numpy()})
        for column, suffix in (("kl", "attn.indexer.kl"), ("overlap_prev", "attn.indexer.overlap_prev")):
            if trace.layers_with(suffix):
                value = trace.site(i, suffix)
                frame[column] = value.numpy() if value is not None else np.nan
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def sinks_table(trace: Trace) -> pd.DataFrame:
    """Per block and key position: the keys the indexer kept **from afar**, as the atlas's
    ``indexer_sinks`` counts them over a corpus, in this prompt. Only queries at least index_topk
    positions after the key count (each had index_topk nearer keys to choose, so nearness is not why
    it kept this one): ``queries`` such queries, ``kept`` those that kept the key, ``share`` = kept /
    queries; each block's keys most kept first. Empty without a recorded selection or when no query
    is that far (T <= index_topk)."""
    blocks = trace.layers_with("attn.indexer.topk_indices")
    n = trace.n_tokens
    if not blocks or not trace.config.has_indexer or n <= trace.config.index_topk:
        return pd.DataFrame()
    first = trace.config.index_topk
    seen = np.arange(n - first)  # the keys some query is that far from
    far = np.arange(n)[:, None] - seen[None, :] >= first  # (T, S'): the pairs from afar
    queries = far.sum(axis=0)  # (S',)
    kept = np.stack(
        [(index_grid(trace.site(b, "attn.indexer.topk_indices").numpy(), n)[:, seen] & far).sum(axis=0) for b in blocks]
    )
    _, tok = _positions(trace)
    frame = pd.DataFrame(
        {
            "block": np.repeat(blocks, len(seen)),
            "position": np.tile(seen, len(blocks)),
            "token": np.tile(tok[seen], len(blocks)),
            "kept": kept.ravel(),  # (blocks * S',)
            "queries": np.tile(queries, len(blocks)),
            "share": (kept / queries).ravel(),
        }
    )
    order = ["block", "share", "kept", "position"]
    return frame.sort_values(order, ascending=[True, False, False, True], ignore_index=True)


def margins_table(trace: Trace) -> pd.DataFrame:
    """Per MoE block and position: the routing margin (the k-th chosen expert's biased score minus the
    best unchosen one's inside the chosen groups) and whether it is a near-tie (below NEAR_TIE); the
    group margin (the weakest chosen group's score minus the best unchosen group's; NaN where the
    trace has none) and whether that is one (``near_tie_group``)."""
    pos, tok = _positions(trace)
    frames = []
    grouped = bool(trace.layers_with("ffn.gate.group_margin"))
    for i in trace.layers_with("ffn.gate.margin"):
        frame = {"block": i, "position": pos, "token": tok, "margin": trace.site(i, "ffn.gate.margin").numpy()}
        if grouped:
            group = trace.site(i, "ffn.gate.group_margin")
            frame["group_margin"] = group.numpy() if group is not None else np.full(len(pos), np.nan, dtype=np.float32)
        frames.append(pd.DataFrame(frame))
    if not frames:
        return pd.DataFrame()
    frame = pd.concat(frames, ignore_index=True)
    frame["near_tie"] = frame["margin"] < NEAR_TIE
    if grouped:
        frame["near_tie_group"] = frame["group_margin"] < NEAR_TIE
    return frame


def _names(trace: Trace, ids) -> list[str]:
    """Token strings for ids, from the strings the run stored (``extra['vocab']``), else ``<id>``."""
    vocab = trace.extra.get("vocab", {})
    return [vocab.get(str(int(i)), f"<{int(i)}>") for i in ids]


def logit_lens_table(trace: Trace) -> pd.DataFrame:
    """Per block, position and rank: the token the final norm and head read from the stream."""
    pos, tok = _positions(trace)
    frames = []
    for i in trace.layers_with("logit_lens.topk_indices"):
        ids = trace.site(i, "logit_lens.topk_indices").numpy()  # (T, L)
        n, top = ids.shape
        data = {
            "block": i,
            "position": np.repeat(pos, top),
            "token": np.repeat(tok, top),
            "rank": np.tile(np.arange(top), n),
            "predicted_id": ids.ravel(),
        }
        data["predicted"] = _names(trace, ids.ravel())
        if trace.site(i, "logit_lens.topk_probs") is not None:
            data["probability"] = trace.site(i, "logit_lens.topk_probs").numpy().ravel()
        frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def next_token_table(trace: Trace, top: int = 10) -> pd.DataFrame:
    """The model's top next tokens after the last position."""
    if "logits.last" not in trace:
        return pd.DataFrame()
    probs = trace["logits.last"].double().softmax(-1)
    values, ids = probs.topk(min(top, probs.numel()))
    return pd.DataFrame(
        {
            "rank": np.arange(len(ids)),
            "token_id": ids.numpy(),
            "token": _names(trace, ids),
            "probability": values.numpy(),
            "logit": trace["logits.last"][ids].numpy(),
        }
    )


ATTRIBUTION_PARTS = ("embed", "head", "expert", "shared", "mlp")  # the kinds that sum, with the rest, to the total


def attribution_table(trace: Trace) -> pd.DataFrame:
    """The direct logit attribution, one row per part (tracing.analyses.attribution): the embedding, each
    head, each chosen routed expert and the shared expert (or a dense block's MLP), then the rest.
    A head's split over the keys it read follows it: ``source`` rows (the key position in
    ``source``, its token in ``source_token``; keys the indexer dropped hold 0 and are not listed)
    and a ``source_rest`` row; after a block's heads, each head's ``dropped keys`` row (what attending
    over every causal key would have added to its part; not a part). ``share`` is the row's |value|
    over the sum of every part's |value| (kinds in ATTRIBUTION_PARTS; the sources split a head's part
    and are not counted twice)."""
    if "attribution.total" not in trace:
        return pd.DataFrame()
    tokens = np.asarray(trace.tokens, dtype=object)
    rows = [("attribution.embed", -1, "embed", -1, -1, float(trace["attribution.embed"][0]))]
    for i in trace.layers_with("attn.attribution"):
        sources, rests = trace.site(i, "attn.attribution_src"), trace.site(i, "attn.attribution_src_rest")
        for head, value in enumerate(trace.site(i, "attn.attribution").tolist()):
            name = part_name(i, f"attn.head.{head}")
            rows.append((name, i, "head", head, -1, value))
            if sources is not None:
                for s in torch.nonzero(sources[head]).flatten().tolist():
                    rows.append((f"{name}.source.{s}", i, "source", head, s, float(sources[head, s])))
            if rests is not None:
                rows.append((f"{name}.source_rest", i, "source_rest", head, -1, float(rests[head])))
        dropped = trace.site(i, "attn.attribution_dropped")
        if dropped is not None:  # not a part: what dense attention would have added to each head's
            for head, value in enumerate(dropped.tolist()):
                rows.append((part_name(i, f"attn.head.{head}.dropped_keys"), i, "dropped keys", head, -1, value))
        parts = trace.site(i, "ffn.attribution").tolist()
        if len(parts) == 1:
            rows.append((part_name(i, "ffn"), i, "mlp", -1, -1, parts[0]))
            continue
        chosen = [e for e, value in enumerate(parts[:-1]) if value != 0.0]  # experts not chosen hold 0
        rows.extend((part_name(i, f"ffn.experts.{e}"), i, "expert", e, -1, parts[e]) for e in chosen)
        rows.append((part_name(i, "ffn.shared_experts"), i, "shared", -1, -1, parts[-1]))
    rows.append(("attribution.rest", -1, "rest", -1, -1, float(trace["attribution.rest"][0])))
    frame = pd.DataFrame(rows, columns=["part", "block", "kind", "index", "source", "value"])
    frame.insert(5, "source_token", np.where(frame["source"] >= 0, tokens[frame["source"].clip(lower=0)], ""))
    magnitude = frame.loc[frame["kind"].isin(ATTRIBUTION_PARTS), "value"].abs().sum()
    frame["share"] = frame["value"].abs() / magnitude if magnitude > 0 else np.nan
    return frame


def expert_lens_table(trace: Trace) -> pd.DataFrame:
    """The per-expert logit lens at the attributed position: per MoE block and chosen routed expert,
    the tokens its weighted output promotes and suppresses most through the frozen final norm and
    the head, with the logit change each gets."""
    frames = []
    position = trace.extra.get("attribution", {}).get("position", -1)
    for i in trace.layers_with("ffn.expert_lens.ids"):
        ids = trace.site(i, "ffn.expert_lens.ids").numpy()  # (E, 2, L), -1 for experts not chosen
        changes = trace.site(i, "ffn.expert_lens.logits")
        experts = np.flatnonzero(ids[:, 0, 0] >= 0)
        chosen = ids[experts]  # (k, 2, L)
        k, _, top = chosen.shape
        frame = {
            "block": i,
            "position": position,
            "expert": np.repeat(experts, 2 * top),
            "direction": np.tile(np.repeat(["promotes", "suppresses"], top), k),
            "rank": np.tile(np.arange(top), 2 * k),
            "token_id": chosen.ravel(),
            "token": _names(trace, chosen.ravel()),
        }
        if changes is not None:
            frame["logit"] = changes.numpy()[experts].ravel()
        frames.append(pd.DataFrame(frame))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def flow_table(trace: Trace) -> pd.DataFrame:
    """The contribution graph (tracing.analyses.flow), one row per edge with a positive share: per block,
    what fed each position's stream: through the attention, each key position (``key``, the
    source in ``source``) and the position's own stream (``residual``); through the FFN, each
    chosen routed expert (``expert``), the shared expert or the dense MLP, and the stream before
    it (``residual``). ``share`` is of the receiving stream (docs/attribution.md)."""
    tokens = np.asarray(trace.tokens, dtype=object)
    columns = ["block", "stage", "position", "token", "kind", "source", "source_token", "expert", "share"]
    frames = []
    for i in trace.layers_with("attn.flow"):
        stages = [("attn", trace.site(i, "attn.flow"), trace.site(i, "attn.flow_resid"))]
        stages.append(("ffn", trace.site(i, "ffn.flow"), trace.site(i, "ffn.flow_resid")))
        for stage, shares, kept in stages:
            if shares is None:
                continue
            grid = shares.numpy()  # (T, S) keys, or (T, E + 1) experts then the shared, or (T, 1) the MLP
            t, col = np.nonzero(grid > 0)
            if stage == "attn":
                kind, source, expert = np.full(len(t), "key", dtype=object), col, np.full(len(t), -1)
            else:
                dense = grid.shape[1] == 1
                last = col == grid.shape[1] - 1
                kind = np.where(last, "mlp" if dense else "shared", "expert").astype(object)
                source, expert = t, np.where(last, -1, col)
            frame = {"block": i, "stage": stage, "position": t, "kind": kind, "source": source, "expert": expert}
            frames.append(pd.DataFrame({**frame, "share": grid[t, col]}))
            if kept is not None:
                pos = np.arange(len(kept))
                frame = {"block": i, "stage": stage, "position": pos, "kind": "residual", "source": pos, "expert": -1}
                frames.append(pd.DataFrame({**frame, "share": kept.numpy()}))
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    out["token"], out["source_token"] = tokens[out["position"]], tokens[out["source"]]
    return out.sort_values(["block", "stage", "position"], kind="stable", ignore_index=True)[columns]


def graph_table(trace: Trace) -> pd.DataFrame:
    """What an intervention graph saved (``graph.<name>``): one row per number, by its row (the passes'
    rows in order: a prefill's, then each decode step's) and its flat index within the row."""
    frames = []
    for name in sorted(n for n in trace.tensors if n.startswith(SAVED)):
        value = trace[name].reshape(len(trace[name]), -1)  # (rows, numbers per row)
        rows, width = value.shape
        frames.append(
            pd.DataFrame(
                {
                    "name": name.removeprefix(SAVED),
                    "row": np.repeat(np.arange(rows), width),
                    "index": np.tile(np.arange(width), rows),
                    "value": value.flatten().numpy(),
                }
            )
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def features_table(trace: Trace) -> pd.DataFrame:
    """Per dictionary, position and rank: a feature active there and its activation, with the norm
    of the dictionary's reconstruction error at the position (tracing.dictionary.features)."""
    pos, tok = _positions(trace)
    info = trace.extra.get("dictionaries", {})
    frames = []
    for name in sorted(trace.tensors, key=site_order):
        if not name.endswith(".features.top_ids"):
            continue
        site = name.removesuffix(".features.top_ids")
        ids = trace[name].numpy()  # (T, F)
        acts, error = trace[f"{site}.features.top_acts"].numpy(), trace[f"{site}.features.error_norm"].numpy()
        rows, ranks = np.nonzero(ids >= 0)
        about = info.get(site, {}) if isinstance(info, dict) else {}
        data = {
            "site": site,
            "dictionary": str(about.get("name", site)),
            "block": layer_site(site)[0],
            "position": pos[rows],
            "token": tok[rows],
            "rank": ranks,
            "feature": ids[rows, ranks],
            "activation": acts[rows, ranks],
            "error_norm": error[rows],
        }
        frames.append(pd.DataFrame(data))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


BUILDERS = {
    "tokens": tokens_table,
    "residual": residual_table,
    "router": router_table,
    "expert_load": expert_load_table,
    "groups": groups_table,
    "indexer": indexer_table,
    "indexer_recall": recall_table,
    "sinks": sinks_table,
    "margins": margins_table,
    "logit_lens": logit_lens_table,
    "next_token": next_token_table,
    "steps": steps_table,
    "attribution": attribution_table,
    "expert_lens": expert_lens_table,
    "flow": flow_table,
    "graph": graph_table,
    "features": features_table,
}


def tables(trace: Trace) -> dict[str, pd.DataFrame]:
    """Every table the trace can give, by name; empty ones left out."""
    out = {}
    for name, build in BUILDERS.items():
        frame = build(trace)
        if not frame.empty:
            out[name] = frame
    return out
