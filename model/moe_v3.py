"""DeepSeek-V3's feed-forward numerics, for a model without the indexer (V3, R1, V3.1).

V3's reference (deepseek-ai/DeepSeek-V3 ``inference/model.py``) builds its modules in bfloat16 and
keeps every intermediate there, where V3.2-Exp's widens to float32: the router's product is a
bfloat16 one (sigmoid in bfloat16, softmax in float32), an expert's ``silu(w1 x) * w3 x`` is formed
in bfloat16, and the routed sum is ``y[idx] += expert(x[idx]) * weight`` into bfloat16 zeros, the
experts in ascending order, then ``y + shared_experts(x)`` in bfloat16. The classes here change
only that arithmetic; :func:`to_v3` swaps a block's FFN to them (the parameters stay as they are).

Hook points still see float32 values where the V3.2 ones do: each bfloat16 value widened (exact),
a replacement rounded back.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, kernels
from .moe import MLP, Expert, Gate, MoE, RouterRule, select_experts


class MLPV3(MLP):
    """SwiGLU with V3's arithmetic: ``silu(w1 x) * w3 x`` in the activation dtype."""

    def hidden(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        x = self.w1.rounded(x) if isinstance(x, torch.Tensor) else x
        return F.silu(self.w1(x)) * self.w3(x)


class ExpertV3(MLPV3, Expert):
    """One routed expert with V3's arithmetic."""


class GateV3(Gate):
    """The router with V3's arithmetic: the scores are the bfloat16 product ``x W^T`` (sigmoid of
    it in bfloat16, or its softmax in float32); the bias, float32, is added for selection; the
    weights are the bfloat16 scores normalised and scaled in bfloat16."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = kernels.linear(x, self.weight)  # (N, E) in x's dtype
        scores = scores.softmax(dim=-1, dtype=torch.float32) if self.score_func == "softmax" else scores.sigmoid()
        rule = RouterRule(self.n_groups, self.topk_groups, self.topk, self.score_func, self.route_scale)
        chosen = select_experts(self._hook_point("scores", scores), self.bias, rule, at=self._hook_point)
        return chosen.topk_weights.type_as(x), chosen.topk_indices

    def _hook_point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return widened(getattr(self, name), value)


class MoEV3(MoE):
    """The mixture of experts with V3's arithmetic: each weighted expert output and each running sum
    rounded to the activation dtype, as V3's ``y[idx] += expert(x[idx]) * weights[idx, top, None]``
    into bfloat16 zeros makes them (the float32 sum of two bfloat16 values rounded once is the
    bfloat16 add)."""

    def route(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, rounded=None) -> torch.Tensor:
        n, k = indices.shape
        flat = indices.flatten()  # (N * k,)
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.n_routed_experts).tolist()
        tokens = order // k
        out = self.run_experts(x, tokens, counts, x.dtype)  # (N * k, D)
        by_token = torch.argsort(tokens * self.n_routed_experts + flat[order], stable=True)
        scale = weights.flatten()[order[by_token]].view(n, k, 1)  # (N, k, 1) in x's dtype
        slots = (kernels.gather(out, by_token).view(n, k, self.dim) * scale).float()  # (N, k, D), bfloat16 products widened
        return self.add_rounded(self.expert_out(self.gather_slots(slots)).to(x.dtype))  # (N, D)

    def run_experts(self, x, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Each expert's output for its rows, sorted by expert (the CPU backend's expert route forms
        the hidden product in float32: not used here)."""
        rows = x.rows(tokens) if isinstance(x, fp8.Rounded) else kernels.gather(x, tokens)  # (N * k, D)
        out = torch.zeros(len(tokens), self.dim, dtype=dtype, device=tokens.device)
        for j, end in enumerate(itertools.accumulate(counts)):
            span = slice(end - counts[j], end)
            if counts[j] and self.experts[j] is not None:
                out[span] = self.experts[j](rows[span])
        return out

    def add_rounded(self, contrib: torch.Tensor) -> torch.Tensor:
        """The k slots (N, k, D) added in order into zeros in their dtype, widened to float32 at the end."""
        y = torch.zeros_like(contrib[:, 0])
        for j in range(contrib.shape[1]):
            y += contrib[:, j]
        return y.float()


def widened(point: nn.Module, value: torch.Tensor) -> torch.Tensor:
    """A value through its hook point widened to float32 (exact); a replacement is rounded back."""
    if not value.is_floating_point() or value.dtype == torch.float32:
        return point(value)
    wide = value.float()
    patched = point(wide)
    return value if patched is wide else patched.to(value.dtype)


def to_v3(ffn: nn.Module) -> nn.Module:
    """A block's FFN (MLP or MoE) with V3's arithmetic, in place: the same modules and parameters."""
    swaps = {MLP: MLPV3, Expert: ExpertV3, Gate: GateV3, MoE: MoEV3}
    for module in ffn.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
    return ffn
