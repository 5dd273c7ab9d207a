"""Comparing two traces: how far the streams drift apart, which experts and which indexer keys
changed, and how the predictions moved.

Two runs of one prompt (an intervention against the plain run) compare position by position; so do
two prompts of one length (a clean and a corrupt prompt), every table marking the positions whose
tokens differ (``same_token``); prompts of different lengths compare at their last positions only
(and the summary says so), where both predict the next token."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..errors import InputError
from ..tables.frames import _names
from ..trace import Trace

_STREAM = ("resid_pre", "resid_mid", "resid_post")


def _check(a: Trace, b: Trace) -> None:
    for name in ("n_layers", "dim", "vocab_size"):  # the streams and the next-token distributions compared entry by entry
        x, y = getattr(a.config, name), getattr(b.config, name)
        if x != y:
            raise InputError(f"the traces come from models of different shapes ({name} {x} and {y})")


def _rows(a: Trace, b: Trace) -> tuple[np.ndarray, np.ndarray]:
    """The positions compared: every one for traces of one length, else each trace's last."""
    if a.n_tokens == b.n_tokens:
        return np.arange(a.n_tokens), np.arange(b.n_tokens)
    return np.array([a.n_tokens - 1]), np.array([b.n_tokens - 1])


def _positions(a: Trace, b: Trace, ia: np.ndarray, ib: np.ndarray) -> dict:
    """The columns every position table has: a's position and token, b's token, and whether they agree."""
    ids_a, ids_b = np.asarray(a.token_ids)[ia], np.asarray(b.token_ids)[ib]
    return {
        "position": ia,
        "token": np.asarray(a.tokens, dtype=object)[ia],
        "token_b": np.asarray(b.tokens, dtype=object)[ib],
        "same_token": ids_a == ids_b,
    }


def _sets(x: np.ndarray) -> list[frozenset]:
    return [frozenset(int(v) for v in row if v >= 0) for row in x]


def stream_diff(a: Trace, b: Trace) -> pd.DataFrame:
    frames = []
    ia, ib = _rows(a, b)
    where = _positions(a, b, ia, ib)
    for i in range(a.config.n_layers):
        for site in _STREAM:
            x, y = a.site(i, site), b.site(i, site)
            if x is None or y is None:
                continue
            x, y = x[ia].double(), y[ib].double()
            rel = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            columns = {"block": i, "site": site, "position": where["position"], "token": where["token"]}
            extra = {"token_b": where["token_b"], "same_token": where["same_token"]}
            frames.append(pd.DataFrame({**columns, "rel_l2": rel.numpy(), "cosine": cos.numpy(), **extra}))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _selection_diff(a: Trace, b: Trace, suffix: str, what: str) -> pd.DataFrame:
    frames = []
    ia, ib = _rows(a, b)
    where = _positions(a, b, ia, ib)
    for i in range(a.config.n_layers):
        x, y = a.site(i, suffix), b.site(i, suffix)
        if x is None or y is None:
            continue
        sa, sb = _sets(x.numpy()[ia]), _sets(y.numpy()[ib])
        frames.append(
            pd.DataFrame(
                {
                    "block": i,
                    "position": where["position"],
                    "token": where["token"],
                    f"{what}_a": [" ".join(map(str, sorted(s))) for s in sa],
                    f"{what}_b": [" ".join(map(str, sorted(s))) for s in sb],
                    "only_a": [len(x - y) for x, y in zip(sa, sb, strict=True)],
                    "only_b": [len(y - x) for x, y in zip(sa, sb, strict=True)],
                    "jaccard": [len(x & y) / max(len(x | y), 1) for x, y in zip(sa, sb, strict=True)],
                    "token_b": where["token_b"],
                    "same_token": where["same_token"],
                }
            ).assign(changed=lambda f: (f.only_a + f.only_b) > 0)
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def predictions_diff(a: Trace, b: Trace) -> pd.DataFrame:
    """Top-1 token of the logit lens per block and position, in both traces."""
    frames = []
    ia, ib = _rows(a, b)
    where = _positions(a, b, ia, ib)
    for i in range(a.config.n_layers):
        ids_a, ids_b = a.site(i, "logit_lens.topk_indices"), b.site(i, "logit_lens.topk_indices")
        if ids_a is None or ids_b is None:
            continue
        top_a, top_b = ids_a[ia, 0].numpy(), ids_b[ib, 0].numpy()
        frame = {
            "block": i,
            "position": where["position"],
            "token": where["token"],
            "top1_a": _names(a, top_a),
            "top1_b": _names(b, top_b),
        }
        prob_a, prob_b = a.site(i, "logit_lens.topk_probs"), b.site(i, "logit_lens.topk_probs")
        if prob_a is not None and prob_b is not None:
            frame["prob_a"], frame["prob_b"] = prob_a[ia, 0].numpy(), prob_b[ib, 0].numpy()
        frame["changed"] = top_a != top_b
        frame["token_b"], frame["same_token"] = where["token_b"], where["same_token"]
        frames.append(pd.DataFrame(frame))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def next_token_diff(a: Trace, b: Trace, top: int = 10) -> pd.DataFrame:
    if "logits.last" not in a or "logits.last" not in b:
        return pd.DataFrame()
    pa, pb = a["logits.last"].double().softmax(-1), b["logits.last"].double().softmax(-1)
    ids = torch.unique(torch.cat([pa.topk(top).indices, pb.topk(top).indices]))
    frame = pd.DataFrame({"token_id": ids.numpy(), "token": _names(a, ids), "prob_a": pa[ids].numpy(), "prob_b": pb[ids].numpy()})
    frame["delta"] = frame.prob_b - frame.prob_a
    return frame.sort_values("prob_a", ascending=False, ignore_index=True)


def diff_tables(a: Trace, b: Trace) -> dict[str, pd.DataFrame]:
    _check(a, b)
    out = {
        "stream": stream_diff(a, b),
        "experts": _selection_diff(a, b, "ffn.gate.topk_indices", "experts"),
        # key positions mean the same in both only for traces of one length
        "indexer_keys": _selection_diff(a, b, "attn.indexer.topk_indices", "keys") if a.n_tokens == b.n_tokens else None,
        "predictions": predictions_diff(a, b),
        "next_token": next_token_diff(a, b),
    }
    return {name: frame for name, frame in out.items() if frame is not None and not frame.empty}


def _figure(value: float, digits: int | None = None) -> float | None:
    """A number for JSON, None where it is undefined (NaN) or unbounded: json.dumps would write
    NaN or Infinity, which JSON does not have."""
    value = float(value)
    if not np.isfinite(value):
        return None
    return round(value, digits) if digits is not None else value


def summary(a: Trace, b: Trace, tables: dict[str, pd.DataFrame] | None = None) -> dict:
    """One JSON-able line: where the runs first differ and by how much, per block. A figure that
    is undefined (from NaN values) is None, so the line stays valid JSON."""
    tables = tables if tables is not None else diff_tables(a, b)
    out: dict = {"tokens": a.n_tokens}
    if a.token_ids != b.token_ids:
        out["tokens_b"] = b.n_tokens
        if a.n_tokens == b.n_tokens:
            out["compared"] = "every position"
            out["differing_positions"] = [p for p in range(a.n_tokens) if a.token_ids[p] != b.token_ids[p]]
        else:
            out["compared"] = f"the last positions only (the prompts have {a.n_tokens} and {b.n_tokens} tokens)"
    stream = tables.get("stream")
    if stream is not None:
        by_block = stream.groupby("block")["rel_l2"]
        per = by_block.max()
        undefined = by_block.apply(lambda v: bool(v.isna().any()))  # a NaN drift leaves the maximum unknown
        out["max_rel_l2_per_block"] = [None if u else _figure(v, 6) for v, u in zip(per.values, undefined.values, strict=True)]
        moved = per[per > 0]
        out["first_block_changed"] = int(moved.index[0]) if len(moved) else None
    for name in ("experts", "indexer_keys"):
        frame = tables.get(name)
        if frame is not None:
            out[f"{name}_changed"] = int(frame.changed.sum())
    if "next_token" in tables:
        pa, pb = a["logits.last"].double().log_softmax(-1), b["logits.last"].double().log_softmax(-1)
        out["next_token_kl"] = _figure((pa.exp() * (pa - pb)).sum())
        out["next_token_a"], out["next_token_b"] = int(pa.argmax()), int(pb.argmax())
    return out
