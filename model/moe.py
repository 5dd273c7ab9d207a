"""Feed-forward layers: the dense MLP, and the mixture of experts with its router (``gate``).

Shapes: N tokens (B * T flattened), D dim, E routed experts, G expert groups, k experts per token.
"""

from __future__ import annotations

import itertools
import operator
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
        scores = ops.threaded(x.numel() * self.weight.shape[0], F.linear, x.float(), self.weight.float())  # (N, E)
        scores = scores.softmax(dim=-1) if self.score_func == "softmax" else scores.sigmoid()
        rule = RouterRule(self.n_groups, self.topk_groups, self.topk, self.score_func, self.route_scale)
        chosen = select_experts(self.scores(scores), self.bias, rule, at=self._hook_point)
        return chosen.topk_weights, chosen.topk_indices

    def _hook_point(self, name: str, value: torch.Tensor) -> torch.Tensor:
        return getattr(self, name)(value)


class ExpertWeights(NamedTuple):
    """A MoE block's experts prepared for one product dtype on the CPU: stacked copies ([w1; w3]
    one product), or each expert's weights laid out for oneDNN (ops.pack)."""

    w13: torch.Tensor | None  # (E, 2 inter, D): [w1; w3] of every expert, stacked
    w2: torch.Tensor | None  # (E, D, inter)
    packed13: list | None  # per expert: ops.pack of [w1; w3]
    packed2: list | None  # per expert: ops.pack of w2
    dtype: torch.dtype  # the product dtype
    inter: int  # moe_inter_dim


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
        # FP8 products round their input per row: x once, for every routed expert and the shared one
        rounded = fp8.Rounded.of(x, self.scale_fmt) if self.fp8 else None
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
            rounded = fp8.Rounded.of(x, self.scale_fmt)
        # regroup by token, each token's experts in ascending order (the order they are added in)
        by_token = torch.argsort(tokens * self.n_routed_experts + flat[order], stable=True)
        prepared = self._expert_weights(x.dtype)
        if prepared is not None:  # every expert's products from weights prepared once: the same products
            out = self._experts(x if rounded is None else rounded, tokens, prepared, counts, x.dtype)
            out = ops.gather(out, by_token).view(n, k, self.dim)
            scale = weights.flatten()[order[by_token]].view(n, k, 1)
            contrib = ops.threaded(out.numel() * ops.VALUE_WORK, lambda: out.float().mul_(scale))
        else:  # each expert's own module (an expert held by another rank is skipped)
            rows = rounded.rows(tokens) if rounded is not None else ops.gather(x, tokens)  # (N * k, D)
            scale = weights.flatten()[order, None]
            out = torch.zeros(n * k, self.dim, dtype=torch.float32, device=x.device)
            for j, end in enumerate(itertools.accumulate(counts)):
                span = slice(end - counts[j], end)  # expert j's rows
                if counts[j] and self.experts[j] is not None:
                    out[span] = self.experts[j](rows[span]) * scale[span]
            contrib = ops.gather(out, by_token).view(n, k, self.dim)
        slots = self.gather_slots(contrib)  # (N, k, D)
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

    def _experts(
        self, x: torch.Tensor | fp8.Rounded, tokens: torch.Tensor, w: ExpertWeights, counts: list[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Expert.forward for every pair, from the prepared weights, rounding as each expert's own
        products would; rows sorted by expert (``tokens`` the token of each, ``counts`` how many
        each expert has). w1 and w3 as one product of twice the width (each output is its own dot
        product: the same values). One product per expert that has rows, the experts split among
        the threads (ops.spread): torch's grouped product on the CPU visits every expert, rows or
        not, and on 2 cores float32 prefill ran 20-25% faster without it at 768 to 3072 rows."""
        a = x.values(w.dtype) if isinstance(x, fp8.Rounded) else x.to(w.dtype)
        a = ops.gather(a, tokens)  # (N k, D)
        rows = a.split(counts)  # each expert's rows

        def product(j: int, b: torch.Tensor, first: bool) -> torch.Tensor:
            packed = w.packed13 if first else w.packed2
            if packed is not None:
                return ops.linear(b, None, packed[j])
            return F.linear(b, (w.w13 if first else w.w2)[j])

        def part(experts: list[int]) -> list[torch.Tensor]:
            both = torch.cat([product(j, rows[j], True) for j in experts])  # (n, 2 inter): w1 x, w3 x
            hidden = self._hidden(both, w, dtype).split([counts[j] for j in experts])
            return [product(j, b, False) for j, b in zip(experts, hidden, strict=True)]

        used = [j for j, c in enumerate(counts) if c]
        per_row = a.shape[1] * 3 * w.inter  # multiply-adds of one row through an expert
        return torch.cat(ops.spread(part, used, [counts[j] * per_row for j in used])).to(dtype)  # (N k, D)

    def _hidden(self, both: torch.Tensor, w: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
        """silu(w1 x) * w3 x from [w1 x, w3 x], rounded as w2's input (rows independently)."""
        gate, up = both[:, : w.inter].to(dtype), both[:, w.inter :].to(dtype)
        hidden = (F.silu(gate.float()) * up.float()).to(dtype)
        return fp8.Rounded.of(hidden, self.scale_fmt).values(w.dtype) if self.fp8 else hidden.to(w.dtype)

    def _expert_weights(self, dtype: torch.dtype) -> ExpertWeights | None:
        """Every expert's weights prepared for products of ``dtype`` activations: laid out for oneDNN
        (ops.pack, one product per expert) where bfloat16 products take that form, else stacked
        (:meth:`_stacked_weights`). None where the experts' own modules run: experts held elsewhere
        (expert parallelism), no copies (GPU, streaming, training), float32 weights, or FP8 scales
        that need the kernel's block order. Made once, kept while the experts hold the same weights."""
        return self._kept("_prepared_experts", dtype, self._prepare)

    def _prepare(self, linears: list[Linear], dtype: torch.dtype) -> ExpertWeights | None:
        compute = ops.product_dtype(dtype)
        if compute == torch.bfloat16 and ops.packed_products_agree():
            return self._pack(linears, dtype)
        stacks = self._stacked_weights(dtype)
        return None if stacks is None else ExpertWeights(*stacks, None, None, compute, stacks[1].shape[-1])

    def _kept(self, name: str, dtype: torch.dtype, make: Callable) -> object | None:
        """``make(linears, dtype)``, kept per product dtype under ``name`` while every expert holds
        the same weight and scale tensors (a streamed block's weights are never kept)."""
        held = self._held()
        if held is None:
            return None
        linears, key = held
        cache, compute = self.__dict__.setdefault(name, {}), ops.product_dtype(dtype)
        known = cache.get(compute)
        if known is not None and len(known[0]) == len(key) and all(map(operator.is_, known[0], key)):
            return known[1]
        made = make(linears, dtype)
        if linears[0].cache_dequantized:  # held like Linear's own copies (None too)
            cache[compute] = (key, made)
        return made

    def _held(self) -> tuple[list[Linear], list] | None:
        """The experts' Linears (w1, w3, w2 expert by expert) and what identifies the weights they
        hold now (read from the parameter dicts: a decode step checks them all in every block)."""
        experts = tuple(self.experts)
        if any(e is None for e in experts):
            return None
        known = self.__dict__.get("_linears")
        if known is None or not all(map(operator.is_, known[0], experts)):
            linears = [lin for e in experts for lin in (e.w1, e.w3, e.w2)]
            known = self.__dict__["_linears"] = (experts, linears, [lin._parameters for lin in linears])
        _, linears, params = known
        return linears, [linears[0].cache_dequantized, *[p["weight"] for p in params], *[p["scale"] for p in params]]

    def _pack(self, linears: list[Linear], dtype: torch.dtype) -> ExpertWeights | None:
        """Each expert's [w1; w3] and w2 through ops.pack; the plain copies are not kept."""
        plans = [lin._prepared(dtype) for lin in linears]
        if any(copy is None or fast is False for fast, copy in plans) or linears[0].weight.dtype == torch.float32:
            return None
        copies = [copy for _, copy in plans]
        for lin in linears:
            lin.drop_copy(dtype)
        packed13 = [ops.pack(torch.cat(copies[i : i + 2])) for i in range(0, len(copies), 3)]
        packed2 = [ops.pack(copy) for copy in copies[2::3]]
        return ExpertWeights(None, None, packed13, packed2, torch.bfloat16, copies[2].shape[-1])

    def _stacked_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The experts' weight copies for ``dtype`` activations (Linear._prepared) as two stacks,
        [w1; w3] (E, 2 inter, D) and w2 (E, D, inter), which the experts' own Linears then share
        (views, no second copy). None where there are no copies to stack
        (see :meth:`_expert_weights`). Made once, kept while the experts hold the same weights."""
        return self._kept("_stacks", dtype, self._stack)

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
