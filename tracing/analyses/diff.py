"""Comparing two traces: how far the streams drift apart, which experts and which indexer keys
changed, and how the predictions moved.

Two runs of one prompt (an intervention against the plain run) compare position by position; so do
two prompts of one length (a clean and a corrupt prompt), every table marking the positions whose
tokens differ (``same_token``); prompts of different lengths compare at their last positions only
(and the summary says so), where both predict the next token. Two checkpoints that share a tokenizer
compare through the same tables: one prompt traced on each in turn (:func:`trace_checkpoints`)."""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch

from model.config import ModelArgs

from ..errors import InputError
from ..runner import TraceRequest
from ..tables.frames import _names
from ..trace import Trace

_STREAM = ("resid_pre", "resid_mid", "resid_post")
_ROWS = 64  # positions of logits compared at once
SHARES = {"a_on_keys_b": "keys_dropped_b", "b_on_keys_a": "keys_dropped_a"}  # a share and the queries it is defined at


def check_shapes(a: ModelArgs, b: ModelArgs, what: str = "the traces come from models") -> None:
    """The streams and the next-token distributions compare entry by entry, block by block: the same
    blocks, width and vocabulary, or InputError (no common prefix of blocks: block i of a deeper
    model is not the same step of the computation)."""
    for name in ("n_layers", "dim", "vocab_size"):
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            raise InputError(f"{what} of different shapes ({name} {x} and {y})")


def _check(a: Trace, b: Trace) -> None:
    check_shapes(a.config, b.config)


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


def _key_mask(keys: torch.Tensor, n_keys: int) -> torch.Tensor:
    """(T, K) selected keys, -1 for none, as a (T, S) mask of the keys selected."""
    mask = torch.zeros(keys.shape[0], n_keys + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(keys < 0, n_keys, keys), True)  # the -1s land in a column dropped below
    return mask[:, :n_keys]


def _selected(trace: Trace, block: int, rows: np.ndarray) -> torch.Tensor | None:
    keys = trace.site(block, "attn.indexer.topk_indices")
    return None if keys is None else keys[rows]


def _share_on(p: torch.Tensor, keys: torch.Tensor | None, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows,) the share of each query's attention ``p`` (T, S) on the selected ``keys``, and how many
    keys the query sees that the selection drops. The share is of the row's own mass: the recorded
    probabilities are rounded (bfloat16 in the model), so a row sums to 1 only within about 1e-3,
    and a sum over all its keys would read 1.001. NaN where no key is dropped (1 by construction: a
    query with no more keys than index_topk keeps every one) and where there is no indexer."""
    if keys is None:
        return np.full(len(positions), np.nan), np.full(len(positions), -1)
    mask = _key_mask(keys, p.shape[-1])  # (T, S)
    visible = torch.arange(p.shape[-1]) <= torch.as_tensor(positions)[:, None]  # causal: keys 0..q
    dropped = (visible & ~mask).sum(-1).numpy()
    share = ((p * mask).sum(-1) / p.sum(-1)).numpy()  # a part over its whole: never above 1
    return np.where(dropped > 0, share, np.nan), dropped


def attention_diff(a: Trace, b: Trace) -> pd.DataFrame:
    """Per block and query position, how the attention mass over the keys moved (mean over heads,
    ``attn.probs_mean``): the total variation ``attn_tv`` = ½ Σ_s |p_a(s) − p_b(s)| (0: the same
    mass on every key, 1: disjoint keys), the key each run reads most, and the share of one run's
    mass on the keys the other's indexer selected (``a_on_keys_b``: how much of a's attention b's
    sparse attention can see), defined only for the queries where that indexer drops a key
    (``keys_dropped_b`` of them; NaN elsewhere, and where b has no indexer). Dense and sparse attention
    compare alike: both are distributions over the visible keys."""
    frames = []
    ia, ib = _rows(a, b)
    where = _positions(a, b, ia, ib)
    for i in range(a.config.n_layers):
        x, y = a.site(i, "attn.probs_mean"), b.site(i, "attn.probs_mean")
        if x is None or y is None or x.shape != y.shape:
            continue
        x, y = x[ia].double(), y[ib].double()  # (T, S)
        frame = {
            "block": i,
            "position": where["position"],
            "token": where["token"],
            "attn_tv": (0.5 * (x - y).abs().sum(-1)).numpy(),
            "top_key_a": x.argmax(-1).numpy(),
            "top_key_b": y.argmax(-1).numpy(),
        }
        for name, p, keys, other in (
            ("a_on_keys_b", x, _selected(b, i, ib), "b"),
            ("b_on_keys_a", y, _selected(a, i, ia), "a"),
        ):
            frame[name], frame[f"keys_dropped_{other}"] = _share_on(p, keys, ia)
        frame["token_b"], frame["same_token"] = where["token_b"], where["same_token"]
        frames.append(pd.DataFrame(frame).assign(changed=lambda f: f.top_key_a != f.top_key_b))
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def logits_diff(a: Trace, b: Trace) -> pd.DataFrame:
    """Per position, from ``logits.all``: KL(p_a ‖ p_b) of the next-token distributions in nats,
    ``Σ_v p_a(v) (log p_a(v) − log p_b(v))``, both top-1 tokens and whether they agree."""
    if "logits.all" not in a or "logits.all" not in b:
        return pd.DataFrame()
    ia, ib = _rows(a, b)
    where = _positions(a, b, ia, ib)
    kl, top_a, top_b = [], [], []
    for start in range(0, len(ia), _ROWS):  # float64 (rows, V) at a time: a long prompt's logits would not fit twice
        la = a["logits.all"][ia[start : start + _ROWS]].double().log_softmax(-1)  # (rows, V)
        lb = b["logits.all"][ib[start : start + _ROWS]].double().log_softmax(-1)
        kl.append((la.exp() * (la - lb)).sum(-1).numpy())
        top_a.append(la.argmax(-1).numpy())
        top_b.append(lb.argmax(-1).numpy())
    kl, top_a, top_b = (np.concatenate(v) for v in (kl, top_a, top_b))
    frame = pd.DataFrame(
        {
            "position": where["position"],
            "token": where["token"],
            "kl": kl,
            "top1_a": _names(a, top_a),
            "top1_b": _names(b, top_b),
            "agree": top_a == top_b,
            "token_b": where["token_b"],
            "same_token": where["same_token"],
        }
    )
    return frame.assign(changed=~frame.agree)


def per_block(tables: dict[str, pd.DataFrame], n_layers: int) -> pd.DataFrame:
    """One row per block from the other tables, means over positions: the drift of the block's output
    (``resid_post``: relative L2 |x_b − x_a| / |x_a|, mean and max, cosine), the experts' and the
    indexer keys' Jaccard |A ∩ B| / |A ∪ B| and the share of positions whose set changed, the
    attention's total variation, and the share of positions whose logit-lens top-1 changed. NaN where
    either trace lacks the measure (a dense block's experts, a model without an indexer's keys)."""
    out = pd.DataFrame({"block": np.arange(n_layers)}).set_index("block")
    columns = (
        ("stream", "rel_l2", "rel_l2_mean", np.mean),
        ("stream", "rel_l2", "rel_l2_max", np.max),
        ("stream", "cosine", "cosine_mean", np.mean),
        ("experts", "jaccard", "experts_jaccard", np.mean),
        ("experts", "changed", "experts_changed_share", np.mean),
        ("indexer_keys", "jaccard", "keys_jaccard", np.mean),
        ("indexer_keys", "changed", "keys_changed_share", np.mean),
        ("attention", "attn_tv", "attn_tv", np.mean),
        ("attention", "changed", "top_key_changed_share", np.mean),
        ("attention", "a_on_keys_b", "a_on_keys_b", np.mean),
        ("attention", "b_on_keys_a", "b_on_keys_a", np.mean),
        ("predictions", "changed", "lens_top1_changed_share", np.mean),
    )
    if not any(name in tables for name, *_ in columns):
        return pd.DataFrame()
    for name, column, label, how in columns:
        frame = tables.get(name)
        if frame is None or frame.empty:
            out[label] = np.nan  # every column always: one schema whatever the two models hold
            continue
        if name == "stream":
            frame = frame[frame["site"] == "resid_post"]
        if column in SHARES:  # the queries where the indexer drops a key: elsewhere the share is 1 by construction
            frame = frame[frame[SHARES[column]] != 0]
        # numpy's, not pandas': a NaN at one position leaves the block's figure NaN, not the others' mean
        out[label] = frame.groupby("block")[column].agg(lambda v, how=how: how(v.to_numpy(dtype=np.float64)))
    return out.reset_index()


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
        "attention": attention_diff(a, b) if a.n_tokens == b.n_tokens else None,
        "predictions": predictions_diff(a, b),
        "logits": logits_diff(a, b),
        "next_token": next_token_diff(a, b),
    }
    out = {name: frame for name, frame in out.items() if frame is not None and not frame.empty}
    blocks = per_block(out, a.config.n_layers)
    return {"blocks": blocks, **out} if not blocks.empty else out


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
    if "logits" in tables:
        out["kl_mean"] = _figure(np.mean(tables["logits"].kl.to_numpy()))
        out["top1_agreement"] = _figure(tables["logits"].agree.mean())
    if "next_token" in tables:
        pa, pb = a["logits.last"].double().log_softmax(-1), b["logits.last"].double().log_softmax(-1)
        out["next_token_kl"] = _figure((pa.exp() * (pa - pb)).sum())
        out["next_token_a"], out["next_token_b"] = int(pa.argmax()), int(pb.argmax())
    return out


def check_tokenizers(
    ids_a: Sequence[int],
    ids_b: Sequence[int],
    vocab_a: int | None = None,
    vocab_b: int | None = None,
    pieces_a: Sequence[str] | None = None,
    pieces_b: Sequence[str] | None = None,
) -> None:
    """Two checkpoints compare position by position only when their tokenizers make the same tokens
    of the prompt: the same ids, and where known the same vocabulary size and the same text for each
    token; else InputError naming the first difference. Two tokenizers that pass agree on everything
    this comparison reads."""
    if vocab_a is not None and vocab_b is not None and vocab_a != vocab_b:
        raise InputError(f"the checkpoints' tokenizers differ: vocabularies of {vocab_a} and {vocab_b} tokens")
    if len(ids_a) != len(ids_b):
        raise InputError(
            f"the checkpoints' tokenizers differ: the prompt is {len(ids_a)} tokens in one and {len(ids_b)} in the other"
        )
    for i, (x, y) in enumerate(zip(ids_a, ids_b, strict=True)):
        if x != y:
            raise InputError(f"the checkpoints' tokenizers differ: token {i} of the prompt is id {x} in one and {y} in the other")
    if pieces_a is not None and pieces_b is not None:
        for i, (x, y) in enumerate(zip(pieces_a, pieces_b, strict=True)):
            if x != y:
                raise InputError(f"the checkpoints' tokenizers differ: id {ids_a[i]} reads {x!r} in one and {y!r} in the other")


def trace_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    request: TraceRequest,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    stream: bool | None = False,
    on_block: Callable[[int, int, int], None] | None = None,
    budgets: tuple[int | None, int | None] = (None, None),
) -> tuple[Trace, Trace]:
    """``request`` traced on checkpoint ``a``, then on ``b`` (directories, or ``demo``), with the same
    sites plus ``logits.all`` (the per-position KL). Refused before any model loads when the shapes
    differ (:func:`check_shapes`) or the tokenizers make other tokens of the prompt
    (:func:`check_tokenizers`). One model in memory at a time: the first is freed before the second
    loads, so a pair of checkpoints needs the memory of the larger; the MTP module stays unloaded
    (nothing here compares its drafts). ``on_block(which, block, n_blocks)``: progress, ``which`` 0 (a) or 1 (b)."""
    from model.checkpoint import SafetensorsSource

    from ..cli.loading import open_checkpoint, resolve_checkpoint
    from ..runner import check_token_ids, encode, run
    from ..tokenizer import Tokenizer

    request = request.check()
    if request.generate or request.prefill is not None or request.patches:
        raise InputError("a checkpoint diff traces one prefill of the prompt: --generate, --prefill and patches do not apply")
    if "logits.all" not in request.record:
        request = dataclasses.replace(request, record=(*request.record, "logits.all"))
    directories = [resolve_checkpoint(path) for path in (a, b)]
    configs = [SafetensorsSource(directory).args for directory in directories]
    check_shapes(*configs, what="the checkpoints are models")
    tokenizers = [Tokenizer(d) if (d / "tokenizer.json").exists() else None for d in directories]
    ids = [encode(request, tokenizer) for tokenizer in tokenizers]
    for config, prompt_ids in zip(configs, ids, strict=True):
        check_token_ids(prompt_ids, config)  # the context length and the vocabulary, before any model loads or decodes
    both = all(t is not None for t in tokenizers)
    check_tokenizers(
        *ids,
        *([t.vocab_size for t in tokenizers] if both else [None, None]),
        *([t.token_strings(i) for t, i in zip(tokenizers, ids, strict=True)] if both else [None, None]),
    )
    traces = []
    for which, directory in enumerate(directories):
        loaded = open_checkpoint(directory, device, dtype, stream, mtp=False, budgets=budgets)  # budgets: streamed tiers
        traces.append(
            run(
                loaded.model,
                request,
                loaded.tokenizer,
                on_block=None if on_block is None else lambda i, which=which: on_block(which, i, configs[0].n_layers),
                extra={"checkpoint": loaded.label},
                device=loaded.device,
                context=loaded.context(),
                plan=loaded.plan,
            )
        )
        used = loaded.device
        del loaded  # before the next one loads
        gc.collect()
        if used.type == "cuda":
            torch.cuda.empty_cache()
    return traces[0], traces[1]


def diff_checkpoints(
    a: str | os.PathLike,
    b: str | os.PathLike,
    prompt: str | None = None,
    *,
    token_ids: Sequence[int] | None = None,
    record: str = "default",
    **load,
) -> dict[str, pd.DataFrame]:
    """The tables of :func:`diff_tables` for one prompt (or token ids) on two checkpoints that share
    a tokenizer, e.g. V3.1-Terminus against V3.2-Exp: ``diff_checkpoints("A", "B", "It is a
    truth")["blocks"]``. ``load``: :func:`trace_checkpoints`'s device, dtype, stream. For the summary
    line too: ``a, b = trace_checkpoints(...)``, then ``summary(a, b)``."""
    request = TraceRequest(prompt=prompt, token_ids=None if token_ids is None else tuple(token_ids), record=record)
    return diff_tables(*trace_checkpoints(a, b, request, **load))
