"""Feed-forward layers: the dense MLP, and the mixture of experts with its router (``gate``).

Shapes: N tokens (B * T flattened), D dim, E routed experts, G expert groups, k experts per token.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, kernels
from .config import ModelArgs
from .hooks import HookPoint
from .kernels import topk
from .linear import Linear


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), the product formed in float32."""

    def __init__(self, dim: int, inter_dim: int, linear_dtype: torch.dtype = torch.bfloat16, scale_fmt: str | None = None):
        super().__init__()
        self.w1 = Linear(dim, inter_dim, linear_dtype, scale_fmt)
        self.w2 = Linear(inter_dim, dim, linear_dtype, scale_fmt)
        self.w3 = Linear(dim, inter_dim, linear_dtype, scale_fmt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.hidden(x))

    def hidden(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        """silu(w1 x) * w3 x, formed in float32, in the activation dtype (x rounded once for both
        FP8 products)."""
        x = self.w1.rounded(x) if isinstance(x, torch.Tensor) else x
        gate, up = self.w1(x), self.w3(x)
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)


class Expert(MLP):
    """One routed expert: a SwiGLU MLP of width moe_inter_dim."""


class RouterRule(NamedTuple):
    """The router's settings, as ``Gate`` holds them."""

    n_groups: int  # G expert groups
    topk_groups: int  # groups a token may use
    topk: int  # k experts per token
    score_func: str  # sigmoid | softmax
    route_scale: float

    @classmethod
    def of(cls, args: ModelArgs) -> RouterRule:
        return cls(args.n_expert_groups, args.n_limited_groups, args.n_activated_experts, args.score_func, args.route_scale)


class Selection(NamedTuple):
    """Each stage of one routing, named as the gate's hook points; the group stages are None with one group."""

    scores: torch.Tensor  # (N, E) s
    biased_scores: torch.Tensor  # (N, E) s + b: what selection ranks
    group_scores: torch.Tensor | None  # (N, G)
    groups: torch.Tensor | None  # (N, topk_groups)
    topk_indices: torch.Tensor  # (N, k) best first
    topk_weights: torch.Tensor  # (N, k) float32


def _unobserved(name: str, value: torch.Tensor) -> torch.Tensor:
    return value


def select_experts(
    scores: torch.Tensor,
    bias: torch.Tensor | None,
    rule: RouterRule,
    at: Callable[[str, torch.Tensor], torch.Tensor] = _unobserved,
) -> Selection:
    """The reference's routing rule from the scores on, in one copy so that the model, the app's
    what-if of the bias and the no-bias intervention cannot drift apart.

    The bias only chooses: groups are ranked by the sum of their top-2 biased scores (by their best
    score when there is no bias), the top-k experts are taken inside the chosen groups, and the
    weights come from the unbiased ``scores``, normalised for sigmoid, times route_scale. Ties go to
    the lower index (``kernels.topk``). ``at(stage, value)`` sees each stage's value as it is made and
    may return another, which the later stages then use: the gate passes its hook points.
    """
    n = scores.size(0)
    biased = at("biased_scores", scores if bias is None else scores + bias)
    group_scores = groups = None
    ranked = biased
    if rule.n_groups > 1:
        grouped = biased.view(n, rule.n_groups, -1)  # (N, G, E/G)
        if bias is None:
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = topk(grouped, 2)[0].sum(dim=-1)
        group_scores = at("group_scores", group_scores)  # (N, G)
        groups = at("groups", topk(group_scores, rule.topk_groups)[1])  # (N, topk_groups)
        mask = grouped.new_ones(n, rule.n_groups, dtype=torch.bool).scatter_(1, groups, False)
        ranked = grouped.masked_fill(mask.unsqueeze(-1), float("-inf")).flatten(1)  # (N, E)
    indices = at("topk_indices", topk(ranked, rule.topk)[1])  # (N, k)
    weights = scores.gather(1, indices)
    if rule.score_func == "sigmoid":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = at("topk_weights", weights * rule.route_scale)  # (N, k) float32
    return Selection(scores, biased, group_scores, groups, indices, weights)


class Gate(nn.Module):
    """The router: sigmoid (or softmax) scores s, then :func:`select_experts` with the correction
    bias b (used only to choose), each stage through its hook point."""

    def __init__(self, args: ModelArgs, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.dim = args.dim
        self.topk = args.n_activated_experts
        self.n_groups = args.n_expert_groups
        self.topk_groups = args.n_limited_groups
        self.score_func = args.score_func
        self.route_scale = args.route_scale
        self.weight = nn.Parameter(torch.empty(args.n_routed_experts, args.dim, dtype=weight_dtype))
        self.bias = nn.Parameter(torch.empty(args.n_routed_experts, dtype=torch.float32)) if args.has_gate_bias else None
        self.scores = HookPoint("N E")  # s: affinities after sigmoid, before the bias
        self.biased_scores = HookPoint("N E")  # s + b: what selection ranks
        self.group_scores = HookPoint("N G")  # per-group score used to pick groups
        self.groups = HookPoint("N topk_groups")  # chosen groups
        self.topk_indices = HookPoint("N k")  # chosen experts, best first
        self.topk_weights = HookPoint("N k")  # their gating weights

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.affinities(x)  # (N, E)
        rule = RouterRule(self.n_groups, self.topk_groups, self.topk, self.score_func, self.route_scale)
        chosen = select_experts(self._hook_point("scores", scores), self.bias, rule, at=self._hook_point)
        return chosen.topk_weights, chosen.topk_indices

    def affinities(self, x: torch.Tensor) -> torch.Tensor:
        """s = sigmoid (or softmax) of x W^T: the bfloat16 weight used in float32, float32 scores."""
        scores = kernels.linear(x.float(), self.weight)  # (N, E)
        return scores.softmax(dim=-1) if self.score_func == "softmax" else scores.sigmoid()

    def _hook_point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)(value)


class MoE(nn.Module):
    """y = shared_experts(x) + sum over the chosen experts e of weight_e * expert_e(x)."""

    gate_class = Gate  # a family's own (model/v3.py: DeepSeek-V3's arithmetic)
    expert_class = Expert
    mlp_class = MLP

    def __init__(self, args: ModelArgs, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        linear = fp8.linear_dtype(args.dtype, weight_dtype)
        self.dim = args.dim
        self.n_routed_experts = args.n_routed_experts
        self.n_activated_experts = args.n_activated_experts
        self.gate = self.gate_class(args, weight_dtype)
        # an entry may be None where this process does not hold the expert (expert parallelism)
        self.experts = nn.ModuleList(
            [self.expert_class(args.dim, args.moe_inter_dim, linear, args.scale_fmt) for _ in range(args.n_routed_experts)]
        )
        self.shared_experts = self.mlp_class(args.dim, args.n_shared_experts * args.moe_inter_dim, linear, args.scale_fmt)
        self.fp8 = linear == torch.float8_e4m3fn
        self.scale_fmt = args.scale_fmt
        self.expert_out = HookPoint("N k D")  # each token's k weighted expert outputs, experts ascending, float32
        self.routed_out = HookPoint("N D")  # sum of the weighted routed experts, float32
        self.shared_out = HookPoint("N D")  # the shared expert's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)  # (N, D)
        weights, indices = self.gate(x)
        # FP8 products round their input per row: x once, for every routed expert and the shared one
        rounded = fp8.rounded(x, self.scale_fmt) if self.fp8 else None
        y = self.routed_out(self.route(x, weights, indices, rounded))
        y = y + self.shared_out(self.shared_experts(x if rounded is None else rounded))
        return y.type_as(x).view(shape)

    def route(
        self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, rounded: fp8.Rounded | None = None
    ) -> torch.Tensor:
        """sum_e weight_e * expert_e(x) per token, in float32, the experts added in ascending order
        as the reference's loop adds them. Token-expert pairs are sorted by expert once, so each
        expert runs on one contiguous slice (the rows and their order the loop would give it).
        ``rounded``: x through fp8.Rounded, for FP8 experts (made here when not given)."""
        n, k = indices.shape
        flat = indices.flatten()  # (N * k,)
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.n_routed_experts).tolist()  # rows per expert
        tokens = order // k
        if self.fp8 and rounded is None:
            rounded = fp8.rounded(x, self.scale_fmt)
        out = self.run_experts(x if rounded is None else rounded, tokens, counts, x.dtype)  # (N * k, D)
        # regroup by token, each token's experts in ascending order (the order they are added in)
        by_token = torch.argsort(tokens * self.n_routed_experts + flat[order], stable=True)
        scale = weights.flatten()[order[by_token]].view(n, k, 1)
        slots = self.weigh(kernels.gather(out, by_token).view(n, k, self.dim), scale)  # (N, k, D) float32
        return self.add_slots(self.expert_out(self.gather_slots(slots)), x.dtype)  # (N, D) float32

    def run_experts(self, x: torch.Tensor | fp8.Rounded, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype):
        """Each expert's output for its rows, the rows sorted by expert (``tokens`` the token of
        each, ``counts`` how many each expert has): (N * k, D) in ``dtype``. An expert held by
        another rank (None here) leaves its rows zero."""
        out = kernels.experts(self.experts, x, tokens, counts, dtype)  # the CPU backend's route, where it has one
        return self.each_expert(x, tokens, counts, dtype) if out is None else out

    def each_expert(self, x: torch.Tensor | fp8.Rounded, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype):
        """:meth:`run_experts` as the reference's loop: each expert's module on its rows."""
        rows = x.rows(tokens) if isinstance(x, fp8.Rounded) else kernels.gather(x, tokens)  # (N * k, D)
        out = torch.zeros(len(tokens), self.dim, dtype=dtype, device=tokens.device)
        for j, end in enumerate(itertools.accumulate(counts)):
            span = slice(end - counts[j], end)  # expert j's rows
            if counts[j] and self.experts[j] is not None:
                out[span] = self.experts[j](rows[span])
        return out

    def weigh(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each expert output (N, k, D) times its gating weight (N, k, 1), in float32."""
        return outputs.float() * weights

    def gather_slots(self, contrib: torch.Tensor) -> torch.Tensor:
        """Every token's k expert outputs where experts are split over ranks (see model.parallel);
        one process holds them all already."""
        return contrib

    def add_slots(self, contrib: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Each token's k weighted expert outputs (N, k, D), lowest-numbered expert first, added in
        that order into float32 zeros, as the reference's loop over experts adds them (``dtype``,
        the activations', is the one a family that adds in it uses)."""
        y = torch.zeros_like(contrib[:, 0])
        for j in range(contrib.shape[1]):
            y += contrib[:, j]
        return y
