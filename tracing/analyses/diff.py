"""Comparing two traces of the same prompt: how far the streams drift apart, which experts and
which indexer keys changed, and how the predictions moved."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from ..errors import InputError
from ..tables.frames import _names
from ..trace import Trace

_STREAM = ("resid_pre", "resid_mid", "resid_post")


def _check(a: Trace, b: Trace) -> None:
    if a.token_ids != b.token_ids:
        raise InputError("the traces are of different prompts (token ids differ): nothing to compare position by position")
    for name in ("n_layers", "dim", "vocab_size"):  # the streams and the next-token distributions compared entry by entry
        x, y = getattr(a.config, name), getattr(b.config, name)
        if x != y:
            raise InputError(f"the traces come from models of different shapes ({name} {x} and {y})")


def _sets(x: np.ndarray) -> list[frozenset]:
    return [frozenset(int(v) for v in row if v >= 0) for row in x]


def stream_diff(a: Trace, b: Trace) -> pd.DataFrame:
    frames = []
    pos, tok = np.arange(a.n_tokens), np.asarray(a.tokens, dtype=object)
    for i in range(a.config.n_layers):
        for site in _STREAM:
            x, y = a.site(i, site), b.site(i, site)
            if x is None or y is None:
                continue
            x, y = x.double(), y.double()
            rel = (x - y).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
            cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
            frames.append(
                pd.DataFrame(
                    {"layer": i, "site": site, "position": pos, "token": tok, "rel_l2": rel.numpy(), "cosine": cos.numpy()}
                )
            )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def _selection_diff(a: Trace, b: Trace, suffix: str, what: str) -> pd.DataFrame:
    frames = []
    tok = np.asarray(a.tokens, dtype=object)
    for i in range(a.config.n_layers):
        x, y = a.site(i, suffix), b.site(i, suffix)
        if x is None or y is None:
            continue
        sa, sb = _sets(x.numpy()), _sets(y.numpy())
        frames.append(
            pd.DataFrame(
                {
                    "layer": i,
                    "position": np.arange(len(sa)),
                    "token": tok,
                    f"{what}_a": [" ".join(map(str, sorted(s))) for s in sa],
                    f"{what}_b": [" ".join(map(str, sorted(s))) for s in sb],
                    "only_a": [len(x - y) for x, y in zip(sa, sb, strict=True)],
                    "only_b": [len(y - x) for x, y in zip(sa, sb, strict=True)],
                    "jaccard": [len(x & y) / max(len(x | y), 1) for x, y in zip(sa, sb, strict=True)],
                }
            ).assign(changed=lambda f: (f.only_a + f.only_b) > 0)
        )
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def predictions_diff(a: Trace, b: Trace) -> pd.DataFrame:
    """Top-1 token of the logit lens per block and position, in both traces."""
    frames = []
    tok = np.asarray(a.tokens, dtype=object)
    for i in range(a.config.n_layers):
        ids_a, ids_b = a.site(i, "logit_lens.topk_indices"), b.site(i, "logit_lens.topk_indices")
        if ids_a is None or ids_b is None:
            continue
        top_a, top_b = ids_a[:, 0].numpy(), ids_b[:, 0].numpy()
        frame = {
            "layer": i,
            "position": np.arange(len(top_a)),
            "token": tok,
            "top1_a": _names(a, top_a),
            "top1_b": _names(b, top_b),
        }
        prob_a, prob_b = a.site(i, "logit_lens.topk_probs"), b.site(i, "logit_lens.topk_probs")
        if prob_a is not None and prob_b is not None:
            frame["prob_a"], frame["prob_b"] = prob_a[:, 0].numpy(), prob_b[:, 0].numpy()
        frame["changed"] = top_a != top_b
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
        "indexer_keys": _selection_diff(a, b, "attn.indexer.topk_indices", "keys"),
        "predictions": predictions_diff(a, b),
        "next_token": next_token_diff(a, b),
    }
    return {name: frame for name, frame in out.items() if not frame.empty}


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
    stream = tables.get("stream")
    if stream is not None:
        by_layer = stream.groupby("layer")["rel_l2"]
        per = by_layer.max()
        undefined = by_layer.apply(lambda v: bool(v.isna().any()))  # a NaN drift leaves the maximum unknown
        out["max_rel_l2_per_layer"] = [None if u else _figure(v, 6) for v, u in zip(per.values, undefined.values, strict=True)]
        moved = per[per > 0]
        out["first_layer_changed"] = int(moved.index[0]) if len(moved) else None
    for name in ("experts", "indexer_keys"):
        frame = tables.get(name)
        if frame is not None:
            out[f"{name}_changed"] = int(frame.changed.sum())
    if "next_token" in tables:
        pa, pb = a["logits.last"].double().log_softmax(-1), b["logits.last"].double().log_softmax(-1)
        out["next_token_kl"] = _figure((pa.exp() * (pa - pb)).sum())
        out["next_token_a"], out["next_token_b"] = int(pa.argmax()), int(pb.argmax())
    return out
