"""The contribution graph (``--record flow``): per block, how much each position's stream fed each
later position through the attention, and how much each expert added, as shares of the receiving
stream.

A block updates position t's stream twice, each time as a sum of parts:

    attention:  x'_t = x_t + sum_s A[t, s],   A[t, s] = sum_h W_o,h (p[t, h, s] v[s, h])
    FFN:        x''_t = x'_t + sum_e g[t, e] E_e(x'_t) + S(x'_t)     (or the dense MLP)

where W_o,h are head h's columns of ``wo`` and the keys s run over those the indexer selected
(any other has p = 0: it is no part, and its share is exactly 0). Each part's share of the
receiving stream y (x'_t, then x''_t) is its proximity to y, normalised over the parts, the
residual x_t (x'_t) included, as in Ferrando and Voita's information-flow routes and
facebookresearch/llm-transparency-tool:

    c(part) = max(0, |y|_1 - |y - part|_1) / sum over parts of the same

A[t, s] sums the heads' vectors before the proximity is taken (a position feeds a position; the
attribution splits heads). ``wo`` reads the FP8-rounded head outputs, so the A[t, s] sum to the
attention update only up to that rounding; the shares are normalised either way.

Cost per block: O(T^2 H D) multiply-adds for the A[t, s] (formed a block of keys at a time, within
a memory budget) and O(T^2 D) for the distances; at the 671B width about the forward's own cost
at T = 512 (docs/attribution.md has the figures).

Shapes: T query positions of this pass, S key positions, H heads, Dv v_head_dim, D dim, k chosen
experts, E routed experts.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from model import kernels
from model.hooks import Hooks
from model.indexer import selected_keys
from model.moe import MoE

from ..sites import site_name
from .heads import HeadReads, wo_columns
from .ranks import Ranks

BUDGET = 4 * 2**20  # bytes of the keys' vectors A[t, s] formed at once: cache-sized (more is slower)
THROUGH_BUDGET = 64 * 2**20  # bytes of keys' values through wo at once (wo is read once per such block)


def proximity(parts: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """max(0, |whole|_1 - |whole - part|_1) for parts (..., T, D) of wholes (T, D): (..., T)."""
    return (whole.abs().sum(-1) - (whole - parts).abs().sum(-1)).clamp(min=0)


def _normalised(parts: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Proximities of the parts (T, P) and of the residual (T,) as shares that sum to 1 per position."""
    total = (parts.sum(-1) + residual).clamp(min=torch.finfo(torch.float32).tiny)  # (T,)
    return parts / total[:, None], residual / total


def attention_flow(
    probs: torch.Tensor,
    values: torch.Tensor,
    columns: torch.Tensor,
    before: torch.Tensor,
    after: torch.Tensor,
    selected: torch.Tensor,
    budget: int = BUDGET,
    through_budget: int = THROUGH_BUDGET,
    heads_sum=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shares of each query's stream after the attention (``after``, T x D) that each key brought,
    all heads together (T, S), and that its own stream ``before`` kept (T,).

    probs (T, H, S), values (S, H, Dv), columns: wo's dequantised weight per head (D, H, Dv);
    selected (T, S) bool: the keys each query's heads read (the others are no part). Keys go
    through wo a block at a time (``through_budget`` bytes: wo is read once per block), and
    their vectors A[t, s] are formed a few keys at a time (``budget`` bytes, cache-sized).
    ``heads_sum`` adds the other ranks' heads into a block of A[t, s] (tensor parallelism: each
    rank holds some heads)."""
    n_queries, n_heads, n_keys = probs.shape
    dim = columns.shape[0]
    norm = after.abs().sum(-1)  # (T,)
    near = probs.new_zeros(n_keys, n_queries)  # (S, T)
    block = max(1, through_budget // (4 * n_heads * dim))
    step = max(1, budget // (4 * n_queries * dim))
    for a in range(0, n_keys, block):
        through = kernels.einsum("shv,dhv->shd", values[a : a + block], columns)  # (s, H, D): each key's value through each head
        for c in range(a, min(n_keys, a + block), step):
            d = min(n_keys, a + block, c + step)
            brought = kernels.matmul(probs[:, :, c:d].permute(2, 0, 1), through[c - a : d - a])  # (s, T, D): A[t, s], all heads
            if heads_sum is not None:
                brought = heads_sum(brought)
            near[c:d] = (norm - brought.sub_(after).abs_().sum(-1)).clamp_(min=0)  # proximity, in place
    near = near.T.masked_fill(~selected, 0.0)
    return _normalised(near, proximity(before, after))


def ffn_flow(parts: torch.Tensor, before: torch.Tensor, after: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Shares of each position's stream after the FFN (``after``, T x D) that each part (T, P, D)
    brought, and that the stream ``before`` it kept (T,)."""
    return _normalised(proximity(parts.transpose(0, 1), after).T, proximity(before, after))


class Flow:
    """Forward hooks that compute the contribution graph block by block, while the block's weights
    are present (also when streamed); ``record`` receives each block's sites by name."""

    def __init__(
        self, model: torch.nn.Module, reads: HeadReads, hooks: Hooks, record: Callable[[dict], None], ranks: Ranks | None = None
    ):
        self.model = model
        self._ranks = ranks or Ranks()
        self._reads = reads
        self._record = record
        self._kept: dict[str, torch.Tensor] = {}
        points = []
        for i, block in enumerate(model.layers):
            points.append((block.resid_pre, "resid_pre"))
            if block.attn.indexer is not None:  # without one (DeepSeek-V3) every causal key is read
                points.append((block.attn.indexer.topk_indices, "topk"))
            points.append((block.resid_mid, partial(self._attention, i)))
            if isinstance(block.ffn, MoE):
                points += [(block.ffn.gate.topk_indices, "experts"), (block.ffn.expert_out, "routed")]
                points.append((block.ffn.shared_out, "shared"))
            else:
                points.append((block.ffn_out, "mlp"))
            points.append((block.resid_post, partial(self._ffn, i)))
        for module, what in points:
            hooks.after(module, self._hook(what))

    def _hook(self, what):
        def hook(module, inputs, output):
            value = output[0] if module.shape.startswith("B") else output  # (T, ...) or (N, ...)
            if callable(what):
                what(value.float())
            else:
                self._kept[what] = value.float() if value.is_floating_point() else value

        return hook

    def _attention(self, layer: int, after: torch.Tensor) -> None:
        attn, reads = self.model.layers[layer].attn, self._reads
        columns = wo_columns(attn.wo.weight, attn.wo.scale, attn.n_heads)  # (D, H, Dv)
        n_queries, n_keys = reads.probs.shape[0], reads.probs.shape[-1]
        if "topk" in self._kept:
            selected = selected_keys(self._kept.pop("topk"), n_keys)  # (T, S)
        else:  # every key up to the query's position (the last T of the S)
            selected = torch.arange(n_keys)[None, :] <= torch.arange(n_keys - n_queries, n_keys)[:, None]
            selected = selected.to(reads.probs.device)
        shares, kept = attention_flow(
            reads.probs,
            reads.values(),
            columns,
            self._kept.pop("resid_pre"),
            after,
            selected,
            heads_sum=lambda part: self._ranks.heads_sum(part, layer),
        )
        self._kept["resid_mid"] = after
        self._record({site_name(layer, "attn.flow"): shares.cpu(), site_name(layer, "attn.flow_resid"): kept.cpu()})

    def _ffn(self, layer: int, after: torch.Tensor) -> None:
        ffn, kept = self.model.layers[layer].ffn, self._kept
        if isinstance(ffn, MoE):
            parts = torch.cat([kept.pop("routed"), kept.pop("shared")[:, None]], dim=1)  # (T, k + 1, D)
            shares, resid = ffn_flow(parts, kept["resid_mid"], after)
            slots = kept.pop("experts").sort(dim=-1).values  # (T, k): expert_out's slots, ascending
            by_expert = shares.new_zeros(len(after), ffn.n_routed_experts + 1)  # (T, E + 1)
            by_expert.scatter_(1, slots, shares[:, :-1])
            by_expert[:, -1] = shares[:, -1]
            shares = by_expert
        else:
            shares, resid = ffn_flow(kept.pop("mlp")[:, None], kept["resid_mid"], after)  # (T, 1)
        kept.pop("resid_mid")
        self._record({site_name(layer, "ffn.flow"): shares.cpu(), site_name(layer, "ffn.flow_resid"): resid.cpu()})
