"""The lightning indexer of DeepSeek Sparse Attention: which keys each query may attend to.

Shapes: B batch, T query positions, S key positions (start_pos + T), H indexer heads,
D index_head_dim, R qk_rope_head_dim, K selected keys (min(index_topk, S)).
"""

from __future__ import annotations

import torch
from torch import nn

from . import fp8
from .cache import LayerCache
from .config import ModelArgs
from .hooks import HookPoint
from .kernels import fp8_index, hadamard, topk
from .linear import Linear
from .norm import LayerNorm
from .rope import apply_rotary_emb


class Indexer(nn.Module):
    """I[t, s] = sum_h w[t, h] * ReLU(q[t, h] . k[s]), in FP8 after a Hadamard rotation; top-k per query."""

    def __init__(self, args: ModelArgs, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        linear = fp8.linear_dtype(args.dtype, weight_dtype)
        self.dim = args.dim
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_head_dim = args.qk_rope_head_dim
        self.index_topk = args.index_topk
        self.scale_fmt = args.scale_fmt
        self.softmax_scale = self.head_dim**-0.5
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, linear, args.scale_fmt)
        self.wk = Linear(self.dim, self.head_dim, linear, args.scale_fmt)
        self.k_norm = LayerNorm(self.head_dim)
        # float32 as the reference holds it (the checkpoint stores bf16): applied to the float32 input
        self.weights_proj = Linear(self.dim, self.n_heads, torch.float32)
        self.head_weights = HookPoint("B T H")  # w[t, h]: weights_proj(x) / sqrt(H)
        self.scores = HookPoint("B T S")  # I[t, s], float32, -inf where masked
        self.topk_indices = HookPoint("B T K")  # selected key positions, -1 for none

    def forward(
        self,
        x: torch.Tensor,
        qr: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
        x_rounded: fp8.Rounded | None = None,
    ) -> torch.Tensor:
        """``qr`` may come rounded (fp8.Rounded) and ``x_rounded`` is x rounded, when MLA's FP8
        projections of the same inputs rounded them already."""
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.head_dim)  # (B, T, H, D)
        q_pe, q_nope = torch.split(q, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis, interleaved=False)  # the indexer's RoPE is not interleaved
        q = torch.cat([q_pe, q_nope], dim=-1)
        k = self.k_norm(self.wk(x if x_rounded is None else x_rounded))  # (B, T, D): one key head shared by all index heads
        k_pe, k_nope = torch.split(k, [self.rope_head_dim, self.head_dim - self.rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, interleaved=False).squeeze(2)
        k = torch.cat([k_pe, k_nope], dim=-1)
        q_fp8, q_scale = fp8.quantised(hadamard(q), self.scale_fmt)  # (B, T, H, D), (B, T, H, 1)
        k_fp8, k_scale = fp8.quantised(hadamard(k), self.scale_fmt)  # (B, T, D), (B, T, 1)
        if cache is not None:
            k_fp8 = cache.index_k.write(start_pos, k_fp8)  # (B, S, D)
            k_scale = cache.index_k_scale.write(start_pos, k_scale)  # (B, S, 1)
        weights = self.head_weights(self.weights_proj(x.float()) * self.n_heads**-0.5)  # (B, T, H)
        weights = weights.unsqueeze(-1) * q_scale * self.softmax_scale  # (B, T, H, 1)
        causal_from = None if mask is None else start_pos  # the CPU route may leave the keys the mask hides at -inf
        index_score = fp8_index(q_fp8, weights.squeeze(-1), k_fp8, k_scale.squeeze(-1), causal_from, q_scale)
        if mask is not None:
            index_score += mask
        index_score = self.scores(index_score)
        topk_indices = topk(index_score, min(self.index_topk, end_pos))[1]  # (B, T, K)
        # top-k of a row with fewer than K visible keys also returns masked ones: mark them -1 (and
        # keys whose score is NaN, which sorts first: a future key must never be listed)
        topk_indices = topk_indices.masked_fill(~(index_score.gather(-1, topk_indices) > float("-inf")), -1)
        return self.topk_indices(topk_indices)


def selected_keys(topk_indices: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Bool (..., S) from selections (..., K): True on each chosen key; entries of -1 choose nothing."""
    slot = torch.where(topk_indices < 0, n_keys, topk_indices)  # -1 goes to a spare column
    keep = topk_indices.new_zeros(*topk_indices.shape[:-1], n_keys + 1, dtype=torch.bool).scatter_(-1, slot, True)
    return keep[..., :n_keys]


def sparse_mask(topk_indices: torch.Tensor, n_keys: int, causal: torch.Tensor | None) -> torch.Tensor:
    """Additive float32 mask (B, T, S): 0 on the selected keys, -inf elsewhere and in the future.

    Entries of -1 select nothing; selections after the query are removed by the causal mask.
    """
    bsz, seqlen, _ = topk_indices.shape
    keep = selected_keys(topk_indices, n_keys)  # (B, T, S)
    mask = torch.zeros(bsz, seqlen, n_keys, device=topk_indices.device).masked_fill_(~keep, float("-inf"))
    if causal is not None:
        mask += causal
    return mask
