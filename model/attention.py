"""Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention.

Shapes: B batch, T query positions, S key positions (start_pos + T), H heads, C kv_lora_rank,
Dn qk_nope_head_dim, R qk_rope_head_dim, Dv v_head_dim.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fp8
from .cache import LayerCache
from .config import ModelArgs
from .hooks import HookPoint
from .indexer import Indexer, sparse_mask
from .kernels import einsum, fake_quant, matmul
from .linear import Linear
from .norm import RMSNorm
from .rope import apply_rotary_emb


class MLA(nn.Module):
    """Queries through a low-rank latent (wq_a, q_norm, wq_b); keys and values from one shared
    latent c_kv (wkv_a, kv_norm, wkv_b) plus a shared RoPE key; each query attends only to the
    keys the indexer selected."""

    norm_class = RMSNorm  # a family's own (model/v3.py: DeepSeek-V3's, with no indexer)
    indexer_class: type[Indexer] | None = Indexer

    def __init__(self, args: ModelArgs, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        linear = fp8.linear_dtype(args.dtype, weight_dtype)
        fmt = args.scale_fmt
        self.dim = args.dim
        self.n_heads = args.n_heads
        self.q_lora_rank = args.q_lora_rank
        self.kv_lora_rank = args.kv_lora_rank
        self.qk_nope_head_dim = args.qk_nope_head_dim
        self.qk_rope_head_dim = args.qk_rope_head_dim
        self.qk_head_dim = args.qk_head_dim
        self.v_head_dim = args.v_head_dim
        self.scale_fmt = fmt
        self.softmax_scale = args.softmax_scale  # (Dn + R)^-0.5, times YaRN's mscale^2

        self.wq_a = Linear(self.dim, self.q_lora_rank, linear, fmt)
        self.q_norm = self.norm_class(self.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(self.q_lora_rank, self.n_heads * self.qk_head_dim, linear, fmt)
        self.wkv_a = Linear(self.dim, self.kv_lora_rank + self.qk_rope_head_dim, linear, fmt)
        self.kv_norm = self.norm_class(self.kv_lora_rank, args.norm_eps)
        self.wkv_b = Linear(self.kv_lora_rank, self.n_heads * (self.qk_nope_head_dim + self.v_head_dim), linear, fmt)
        self.wo = Linear(self.n_heads * self.v_head_dim, self.dim, linear, fmt)
        self.indexer = None if self.indexer_class is None else self.indexer_class(args, weight_dtype)
        self.scores = HookPoint("B T H S")  # scaled logits q.k before any mask (dense attention's input)
        self.probs = HookPoint("B T H S")  # attention probabilities after the sparse and causal masks
        self.head_out = HookPoint("B T H Dv")  # each head's output p v, before wo mixes the heads

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        end_pos = start_pos + seqlen
        xr = self.wq_a.rounded(x)  # FP8 projections round their input: once for wq_a, wkv_a and the indexer's wk
        qr = self.wq_b.rounded(self.q_norm(self.wq_a(xr)))  # (B, T, q_lora_rank), for wq_b and the indexer's
        q = self.wq_b(qr).view(bsz, seqlen, self.n_heads, self.qk_head_dim)  # (B, T, H, Dn + R)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv = self.wkv_a(xr)  # (B, T, C + R)
        kv, k_pe = torch.split(kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_norm(kv)  # (B, T, C)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)  # (B, T, R)
        # deployment keeps the latent in an FP8 cache: round it through FP8 as the reference does
        kv = fake_quant(kv, self.scale_fmt)
        if cache is not None:
            kv = cache.kv.write(start_pos, kv)  # (B, S, C)
            k_pe = cache.pe.write(start_pos, k_pe)  # (B, S, R)
        topk_indices = self.indexer(x, qr, start_pos, freqs_cis, mask, cache, xr)  # (B, T, K)
        index_mask = sparse_mask(topk_indices, end_pos, mask).unsqueeze(2).to(x.dtype)  # (B, T, 1, S): 0 or -inf
        if mask is not None:  # prefill: expand the latent to per-head keys and values (MHA)
            q = torch.cat([q_nope, q_pe], dim=-1)  # (B, T, H, Dn + R)
            kv = self.wkv_b(kv).view(bsz, end_pos, self.n_heads, self.qk_nope_head_dim + self.v_head_dim)
            k_nope, v = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)  # (B, S, H, .)
            k = torch.cat([k_nope, k_pe.unsqueeze(2).expand(-1, -1, self.n_heads, -1)], dim=-1)
            scores = self.scores(einsum("bshd,bthd->bsht", q, k).mul_(self.softmax_scale))  # (B, T, H, S)
            scores = scores + index_mask
            scores = self.probs(scores.softmax(dim=-1))
            x = einsum("bsht,bthd->bshd", scores, v)  # (B, T, H, Dv)
        else:  # decode: absorb wkv_b into the query and the output, attend over the latent (MQA)
            x = self._mqa(q_nope, q_pe, kv, k_pe, index_mask)  # (B, T, H, Dv)
        return self.wo(self.head_out(x).flatten(2))

    def _mqa(self, q_nope, q_pe, kv, k_pe, index_mask) -> torch.Tensor:
        """One position's attention over the cached latents: wkv_b's key part absorbed into the query,
        its value part into the output. For one sequence, the products einsum forms (batched over
        heads, or over the sequence) are called directly: its reshaping cost more than they do."""
        wkv_b = self.wkv_b.dequantized(q_nope.dtype).view(self.n_heads, -1, self.kv_lora_rank)  # (H, Dn + Dv, C)
        w_k, w_v = wkv_b[:, : self.qk_nope_head_dim], wkv_b[:, -self.v_head_dim :]  # (H, Dn, C), (H, Dv, C)
        bsz, heads = q_nope.size(0), self.n_heads
        if bsz == 1 and q_nope.size(1) == 1:
            q_nope = matmul(q_nope.view(heads, 1, -1), w_k).view(1, 1, heads, -1)  # (B, T, H, C)
            scores = matmul(q_nope.view(1, heads, -1), kv.transpose(1, 2)) + matmul(q_pe.view(1, heads, -1), k_pe.transpose(1, 2))
            scores = scores.view(1, 1, heads, -1) * self.softmax_scale  # (B, T, H, S)
        else:
            q_nope = einsum("bshd,hdc->bshc", q_nope, w_k)  # (B, T, H, C)
            scores = (einsum("bshc,btc->bsht", q_nope, kv) + einsum("bshr,btr->bsht", q_pe, k_pe)) * self.softmax_scale
        scores = self.scores(scores)
        if index_mask is not None:
            scores = scores + index_mask
        scores = self.probs(self.softmax(scores, q_pe.dtype))  # (B, T, H, S)
        if bsz == 1 and scores.size(1) == 1:
            x = matmul(scores.view(1, heads, -1), kv).view(heads, 1, -1)  # (H, T, C)
            return matmul(x, w_v.transpose(1, 2)).view(1, 1, heads, -1)  # (B, T, H, Dv)
        x = einsum("bsht,btc->bshc", scores, kv)  # (B, T, H, C)
        return einsum("bshc,hdc->bshd", x, w_v)  # (B, T, H, Dv)

    def softmax(self, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The decode's attention probabilities, in the scores' dtype (``dtype``: the activations')."""
        return scores.softmax(dim=-1)
