"""The indexer's recall: the share of the dense attention mass that falls on the keys it selected.

One computation for the trace site ``layers.{i}.attn.indexer.recall`` and for the atlas. The dense
distribution is MLA's softmax of the scaled logits (``attn.scores``) under the causal mask alone, per
head, formed in float32 from the logits as they are (widened exactly, then masked); its
probabilities are gathered at the K selected keys and added, so no (T, S) mask of the selection is
built or multiplied in. The recall and the KL read the same dense distribution: inside
:func:`one_dense` it is formed once per scores tensor. Under tensor parallelism each rank forms it
for its own heads only, and the means over heads add the ranks' sums (the tracer's derived sites).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

import torch

# (scores, their dense distribution) while one_dense is entered: scoped, so nothing outlives the hook
_DENSE: contextvars.ContextVar[list | None] = contextvars.ContextVar("dense_attention", default=None)


@contextlib.contextmanager
def one_dense() -> Iterator[None]:
    """Within it, :func:`dense_attention` of one scores tensor is computed once (the tracer enters
    it around the derivations of one hook's value: the recall and the KL of a block); on exit the
    distribution is dropped, so a block's (T, H, S) float32 copy lives no longer than its hook."""
    token = _DENSE.set([])
    try:
        yield
    finally:
        _DENSE.reset(token)


def dense_attention(scores: torch.Tensor) -> torch.Tensor:
    """MLA's softmax of the scaled logits ``scores`` (B, T, H, S) under the causal mask alone, float32."""
    memo = _DENSE.get()
    if memo and memo[0] is scores:
        return memo[1]
    # masked in float32 (a copy: the model's scores stay as they are), as softmax(dtype=float32) widens first
    dense = _mask_causal(scores.to(torch.float32, copy=True)).softmax(dim=-1)  # (B, T, H, S)
    if memo is not None:
        memo[:] = [scores, dense]
    return dense


def head_recall(scores: torch.Tensor, selected: torch.Tensor, distinct: bool = False) -> torch.Tensor:
    """Per query and head, the dense attention mass on the selected keys, float32.

    ``scores`` (B, T, H, S): scaled logits of the last T queries of S positions over every key;
    ``selected`` (B, T, K): key positions, -1 for none. A key after its query counts not at all and
    a key listed twice once, as the sparse mask treats them; ``distinct`` says no key is listed
    twice (the indexer's own top-k; a forced selection may repeat one), which saves a sort.
    """
    bsz, seqlen, heads, n_keys = scores.shape
    dense = dense_attention(scores)  # (B, T, H, S)
    keys = selected if distinct else selected.sort(dim=-1).values  # (B, T, K)
    query = torch.arange(n_keys - seqlen, n_keys, device=keys.device)[None, :, None]  # (1, T, 1)
    valid = (keys >= 0) & (keys <= query)
    if not distinct:
        valid[..., 1:] &= keys[..., 1:] != keys[..., :-1]
    picked = dense.gather(-1, keys.clamp(min=0)[:, :, None, :].expand(-1, -1, heads, -1))  # (B, T, H, K)
    return (picked * valid[:, :, None, :]).sum(dim=-1)  # (B, T, H)


def _mask_causal(scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (B, T, ..., S), in place, with -inf at the keys after each query (the last T of S positions)."""
    seqlen, n_keys = scores.shape[1], scores.shape[-1]
    if seqlen == 1:  # a decode step's one query sees every key
        return scores
    causal = torch.ones(seqlen, n_keys, dtype=torch.bool, device=scores.device).tril(n_keys - seqlen)  # (T, S)
    shape = (1, seqlen, *([1] * (scores.dim() - 3)), n_keys)
    return scores.masked_fill_(~causal.view(shape), float("-inf"))


def indexer_kl(
    scores: torch.Tensor, index_scores: torch.Tensor, heads_mean: Callable[[torch.Tensor, int], torch.Tensor] = torch.mean
) -> torch.Tensor:
    """Per query, KL(p || q) in nats: p the dense attention distribution (softmax of the scaled logits
    under the causal mask, mean over heads), q the indexer's (softmax of its scores over the keys it
    may see): what the indexer was trained to make small. ``scores`` (B, T, H, S), ``index_scores``
    (B, T, S) with -inf where masked; returns (B, T) float32. ``heads_mean(x, dim)``: the mean over
    the heads (under tensor parallelism ``scores`` holds this rank's heads, and the mean adds the
    other ranks' sums: tracing.analyses.ranks.Ranks.heads_mean)."""
    p = heads_mean(dense_attention(scores), 2)  # (B, T, S)
    log_q = index_scores.float().log_softmax(dim=-1)  # (B, T, S)
    positive = p > 0
    # the keys of p = 0 (after the query: about half) take log(1), not log of a subnormal (ten times slower)
    log_p = torch.where(positive, p, 1.0).clamp_min(1e-38).log()
    terms = torch.where(positive, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def key_overlap(a: torch.Tensor, b: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Per query, the Jaccard overlap |A & B| / |A | B| of two selections (B, T, K) of key positions
    (-1 for none; a key listed twice counts once); 1 where both are empty. Returns (B, T) float32."""

    def chosen(x: torch.Tensor) -> torch.Tensor:  # (B, T, S + 1): the keys held, a slot for -1 dropped
        out = torch.zeros(*x.shape[:2], n_keys + 1, dtype=torch.bool, device=x.device)
        return out.scatter_(-1, (x + 1).clamp(min=0), True)[..., 1:]

    sa, sb = chosen(a), chosen(b)
    both, either = (sa & sb).sum(-1).float(), (sa | sb).sum(-1).float()
    return torch.where(either > 0, both / either.clamp_min(1), torch.ones_like(both))
