"""Feed-forward layers: the dense MLP, and the mixture of experts with its router (``gate``).

Shapes: N tokens (B * T flattened), D dim, E routed experts, G expert groups, k experts per token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, ops
from .config import ModelArgs
from .hooks import HookPoint
from .linear import Linear
from .ops import topk

_grouped_mm = getattr(torch, "_grouped_mm", None)  # one product over row groups (torch >= 2.8)


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
        """silu(w1 x) * w3 x, formed in float32, in the activation dtype."""
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
    the lower index (``ops.topk``). ``at(stage, value)`` sees each stage's value as it is made and
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
        scores = F.linear(x.float(), self.weight.float())  # (N, E)
        scores = scores.softmax(dim=-1) if self.score_func == "softmax" else scores.sigmoid()
        rule = RouterRule(self.n_groups, self.topk_groups, self.topk, self.score_func, self.route_scale)
        chosen = select_experts(self.scores(scores), self.bias, rule, at=self._hook_point)
        return chosen.topk_weights, chosen.topk_indices

    def _hook_point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)(value)


class MoE(nn.Module):
    """y = shared_experts(x) + sum over the chosen experts e of weight_e * expert_e(x)."""

    def __init__(self, args: ModelArgs, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        linear = fp8.linear_dtype(args.dtype, weight_dtype)
        self.dim = args.dim
        self.n_routed_experts = args.n_routed_experts
        self.n_activated_experts = args.n_activated_experts
        self.gate = Gate(args, weight_dtype)
        # an entry may be None where this process does not hold the expert (expert parallelism)
        self.experts = nn.ModuleList(
            [Expert(args.dim, args.moe_inter_dim, linear, args.scale_fmt) for _ in range(args.n_routed_experts)]
        )
        self.shared_experts = MLP(args.dim, args.n_shared_experts * args.moe_inter_dim, linear, args.scale_fmt)
        self.fp8 = linear == torch.float8_e4m3fn
        self.scale_fmt = args.scale_fmt
        self.expert_out = HookPoint("N k D")  # each token's k weighted expert outputs, experts ascending, float32
        self.routed_out = HookPoint("N D")  # sum of the weighted routed experts, float32
        self.shared_out = HookPoint("N D")  # the shared expert's output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.size()
        x = x.view(-1, self.dim)  # (N, D)
        weights, indices = self.gate(x)
        y = self.routed_out(self.route(x, weights, indices))
        y = y + self.shared_out(self.shared_experts(x))
        return y.type_as(x).view(shape)

    def route(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """sum_e weight_e * expert_e(x) per token, in float32, the experts added in ascending order
        as the reference's loop adds them. Token-expert pairs are sorted by expert once, so each
        expert runs on one contiguous slice (the rows and their order the loop would give it)."""
        n, k = indices.shape
        flat = indices.flatten()  # (N * k,)
        order = torch.argsort(flat, stable=True)  # grouped by expert, tokens ascending within
        counts = torch.bincount(flat, minlength=self.n_routed_experts).tolist()
        ends = torch.tensor(counts).cumsum(0).tolist()
        # (expert, its slice of the sorted pairs); an expert held by another rank is None
        spans = [(e, end - c, end) for e, c, end in zip(self.experts, counts, ends, strict=True) if c and e is not None]
        tokens = order // k
        # FP8 products round their input per row: round each token once, not once per product
        rows = (fp8.Rounded.of(x, self.scale_fmt) if self.fp8 else x)[tokens]  # (N * k, D), grouped by expert
        scale = weights.flatten()[order, None]
        stacks = self._stacked_weights(x.dtype) if len(spans) > 1 else None
        if stacks is not None:  # every expert's product at once: the same per-slice products
            out = self._grouped(rows, stacks, torch.tensor(ends, dtype=torch.int32), x.dtype) * scale
        else:
            out = torch.zeros(n * k, self.dim, dtype=torch.float32, device=x.device)
            for expert, a, b in spans:
                out[a:b] = expert(rows[a:b]) * scale[a:b]
        # regroup by token, each token's experts in ascending order, and add in that order
        by_token = torch.argsort(tokens * self.n_routed_experts + flat[order], stable=True)
        slots = self.gather_slots(out[by_token].view(n, k, self.dim))  # (N, k, D)
        return self.add_slots(self.expert_out(slots))  # (N, D)

    def gather_slots(self, contrib: torch.Tensor) -> torch.Tensor:
        """Every token's k expert outputs where experts are split over ranks (see model.parallel);
        one process holds them all already."""
        return contrib

    def add_slots(self, contrib: torch.Tensor) -> torch.Tensor:
        """Each token's k weighted expert outputs (N, k, D), best-numbered expert first, added in
        that order into float32 zeros, as the reference's loop over experts adds them."""
        y = torch.zeros_like(contrib[:, 0])
        for j in range(contrib.shape[1]):
            y += contrib[:, j]
        return y

    def _grouped(self, rows: torch.Tensor | fp8.Rounded, stacks: tuple, ends: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Expert.forward for all experts in two grouped products (rows sorted by expert, ``ends``
        the cumulative row counts), rounding as each expert's own products would: w1 and w3 as one
        product of twice the width (each output is its own dot product: the same values)."""
        w13, w2 = stacks  # (E, 2 inter, D), (E, D, inter) in the product dtype
        inter = w2.shape[-1]
        a = rows.values() if isinstance(rows, fp8.Rounded) else rows  # (N k, D)
        both = _grouped_mm(a.to(w13.dtype), w13.transpose(1, 2), offs=ends)  # (N k, 2 inter): w1 x, w3 x
        gate, up = both[:, :inter].to(dtype), both[:, inter:].to(dtype)
        hidden = (F.silu(gate.float()) * up.float()).to(dtype)
        h = fp8.Rounded.of(hidden, self.scale_fmt).values() if isinstance(rows, fp8.Rounded) else hidden
        return _grouped_mm(h.to(w2.dtype), w2.transpose(1, 2), offs=ends).to(dtype)  # (N k, D)

    def _stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' weight copies for ``dtype`` activations (Linear._prepared) as two stacks,
        [w1; w3] (E, 2 inter, D) and w2 (E, D, inter), which the experts' own Linears then share
        (views, no second copy). None where products run one expert at a time: no grouped product
        in this torch, experts held elsewhere (expert parallelism), no copies (GPU, streaming,
        training), float32 weights (stacking would copy them), or FP8 scales that need the
        kernel's block order."""
        if _grouped_mm is None or any(e is None for e in self.experts):
            return None
        linears = [lin for e in self.experts for lin in (e.w1, e.w3, e.w2)]  # expert by expert
        # one stack per product dtype, valid while every expert holds the same weight and scale tensors
        # (a decode step would otherwise check hundreds of copies per block)
        held = (linears[0].cache_dequantized, *(t for lin in linears for t in (lin.weight, lin.scale)))
        stacks, compute = self.__dict__.setdefault("_stacks", {}), ops.product_dtype(dtype)
        known = stacks.get(compute)
        if known is not None and all(a is b for a, b in zip(known[0], held, strict=True)):
            return known[1]
        stacked = self._stack(linears, dtype)
        if stacked is not None:  # held like Linear's own copies; a streamed block's weights are never held
            stacks[compute] = (held, stacked)
        return stacked

    def _stack(self, linears: list[Linear], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        plans = [lin._prepared(dtype) for lin in linears]
        if any(copy is None or fast is False for fast, copy in plans):
            return None
        if linears[0].weight.dtype == torch.float32:  # the copies are the weights: a stack would be a second
            return None
        copies = [copy for _, copy in plans]
        w13 = torch.stack([torch.cat(copies[i : i + 2]) for i in range(0, len(copies), 3)])  # (E, 2 inter, D)
        w2 = torch.stack(copies[2::3])  # (E, D, inter)
        inter = w2.shape[-1]
        views = [v for e in range(len(self.experts)) for v in (w13[e, :inter], w13[e, inter:], w2[e])]
        for lin, view in zip(linears, views, strict=True):
            lin.share_copy(view)
        return w13, w2
