"""DeepSeek-V3 (R1, V3.1): the architecture without the indexer, computed as V3's own reference
computes it (deepseek-ai/DeepSeek-V3 ``inference/model.py`` with its defaults, ``gemm_impl="bf16"``
and ``attn_impl="absorb"``, the modules built in bfloat16 as its ``generate.py`` does).

A config of model_type ``deepseek_v3`` builds this module's :class:`Transformer` (names.FAMILIES).
Each class is V3.2-Exp's module of the same name with only the steps whose arithmetic differs
overridden (docs/numerics.md has the table):

- the products take their activations unrounded (fp8.unrounded_activations: the FP8 weight
  dequantised to the activation dtype, x as it is);
- RMSNorm: ``F.rms_norm`` in the activation dtype, the gain rounded to it;
- MLA: no indexer; every pass in the absorbed form over the latent as ``kv_norm`` gives it (no FP8
  simulation), with the causal mask only; the softmax formed in float32 and rounded;
- SwiGLU: ``silu(w1 x) * w3 x`` in the activation dtype;
- router: a bfloat16 product, sigmoid in bfloat16 (softmax in float32), the weights in bfloat16;
- MoE sum: ``y[idx] += expert(x[idx]) * weight`` into bfloat16 zeros, the experts in ascending order;
- Block: ``x = x + f(norm(x))``, added in the activation dtype;
- head: the normalised states in the activation dtype, the logits rounded to it.

Hook points have V3.2's names and see float32 values where V3.2's do: each bfloat16 value widened
(exact), a replacement rounded back (:func:`widened`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import attention, fp8, kernels, moe, norm, transformer
from .cache import LayerCache
from .rope import apply_rotary_emb


class RMSNorm(norm.RMSNorm):
    """V3's norm: ``F.rms_norm`` in the activation dtype (``dtype``, default the input's), the gain
    held in it too (V3's checkpoints store it in bfloat16)."""

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        return F.rms_norm(x.to(dtype), (self.dim,), self.weight.to(dtype), self.eps)


class MLA(attention.MLA):
    """V3's MLA (its reference's ``attn_impl="absorb"``): prefill and decode alike attend over the
    cached latent with wkv_b absorbed, every causal key; the latent is cached in the activation
    dtype as ``kv_norm`` gives it."""

    norm_class = RMSNorm
    indexer_class = None

    def forward(
        self,
        x: torch.Tensor,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        bsz, seqlen, _ = x.size()
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(bsz, seqlen, self.n_heads, self.qk_head_dim)  # (B, T, H, Dn + R)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_emb(q_pe, freqs_cis)
        kv, k_pe = torch.split(self.wkv_a(x), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)  # (B, T, C), (B, T, R)
        kv = self.kv_norm(kv)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis).squeeze(2)
        if cache is not None:
            kv = cache.kv.write(start_pos, kv)  # (B, S, C)
            k_pe = cache.pe.write(start_pos, k_pe)  # (B, S, R)
        causal = None if mask is None else mask.to(x.dtype).unsqueeze(1)  # (T, 1, S): 0 or -inf, in the scores' dtype
        return self.wo(self.head_out(self._mqa(q_nope, q_pe, kv, k_pe, causal)).flatten(2))

    def softmax(self, scores: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """V3's ``softmax(dim=-1, dtype=torch.float32).type_as(x)``."""
        return scores.softmax(dim=-1, dtype=torch.float32).to(dtype)


class MLP(moe.MLP):
    """SwiGLU with ``silu(w1 x) * w3 x`` formed in the activation dtype."""

    def hidden(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        x = self.w1.rounded(x) if isinstance(x, torch.Tensor) else x
        return F.silu(self.w1(x)) * self.w3(x)


class Expert(MLP, moe.Expert):
    """One routed expert with V3's SwiGLU."""


class Gate(moe.Gate):
    """The router with the scores a bfloat16 product ``x W^T`` (sigmoid of it in bfloat16, or its
    softmax in float32); the float32 bias is added for selection; the weights are the bfloat16
    scores normalised and scaled in bfloat16."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, indices = super().forward(x)
        return weights.type_as(x), indices

    def affinities(self, x: torch.Tensor) -> torch.Tensor:
        scores = kernels.linear(x, self.weight)  # (N, E) in x's dtype
        return scores.softmax(dim=-1, dtype=torch.float32) if self.score_func == "softmax" else scores.sigmoid()

    def _hook_point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return widened(getattr(self, name), value)


class MoE(moe.MoE):
    """The routed sum as ``y[idx] += expert(x[idx]) * weights[idx, top, None]`` into bfloat16 zeros
    forms it: each weighted expert output and each running sum rounded to the activation dtype (the
    float32 sum of two bfloat16 values rounded once is the bfloat16 add). The experts run one by
    one: the CPU backend's expert route forms V3.2's float32 SwiGLU."""

    gate_class = Gate
    expert_class = Expert
    mlp_class = MLP

    def run_experts(self, x, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
        return self.each_expert(x, tokens, counts, dtype)

    def weigh(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The bfloat16 product, widened (exactly) to float32."""
        return (outputs * weights).float()

    def add_slots(self, contrib: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        contrib = contrib.to(dtype)  # (N, k, D): exact, but for a hook's replacement
        y = torch.zeros_like(contrib[:, 0])
        for j in range(contrib.shape[1]):
            y += contrib[:, j]
        return y.float()


class Block(transformer.Block):
    """V3's reference block, ``x = x + attn(attn_norm(x)); x = x + ffn(ffn_norm(x))``: the adds in
    the activation dtype. The stream's hook points see it widened to float32."""

    attention_class = MLA
    mlp_class = MLP
    moe_class = MoE
    norm_class = RMSNorm

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        stream = widened(self.resid_pre, x if residual is None else x + residual)  # (B, T, D)
        attn = self.attn_out(self.attn(self.attn_norm(stream), start_pos, freqs_cis, mask, cache))
        stream = widened(self.resid_mid, stream + attn)
        x = self.ffn_out(self.ffn(self.ffn_norm(stream)))
        if self.resid_post.observed:  # this sum is otherwise first formed by the next block
            after = x + stream
            if (patched := widened(self.resid_post, after)) is not after:
                return patched, None
        return x, stream


class Transformer(transformer.Transformer):
    """DeepSeek-V3's model: its blocks and norm; every product is V3's ``gemm_impl="bf16"`` one
    (fp8.unrounded_activations); the head is a bfloat16 product (the logits rounded to the
    activation dtype, then widened)."""

    block_class = Block
    norm_class = RMSNorm

    def forward(self, *args, **kwargs):
        with fp8.unrounded_activations():
            return super().forward(*args, **kwargs)

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        return self.norm(h if residual is None else h + residual)

    def head_input(self, normed: torch.Tensor) -> torch.Tensor:
        return normed


def widened(point: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """``value`` through its hook point, a float value widened to float32 (exact); a replacement is
    checked for shape and rounded back to ``value``'s dtype."""
    wide = value.float() if value.is_floating_point() else value
    if (patched := point(wide)) is wide:
        return value
    return transformer.like(patched, wide).to(value.dtype)
