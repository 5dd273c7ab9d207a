"""A MoE block's routed experts on the CPU, split among the threads: FP8 experts summed in the
kernel's block order, each on its own rows, the block's rows decoded once; otherwise every expert's
weights prepared once for the product dtype, [w1; w3] as one product.

The values are each expert's own (model.moe.Expert on its rows, as the block's loop calls it): each
output of a product is its own dot product, so w1 and w3 as one product of twice the width give
the same values, and rows round independently through FP8, so rounding all rows at once does too.
"""

from __future__ import annotations

import itertools
import weakref
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import fp8
from . import fp8 as fast_fp8
from . import products, weights
from .threads import spread


class ExpertWeights(NamedTuple):
    """A block's experts prepared for one product dtype: each expert's [w1; w3] and w2 laid out for
    oneDNN (products.pack), or stacked copies."""

    w13: torch.Tensor | None  # (E, 2 inter, D): [w1; w3] of every expert, stacked
    w2: torch.Tensor | None  # (E, D, inter)
    packed13: list | None  # per expert: products.pack of [w1; w3]
    packed2: list | None  # per expert: products.pack of w2
    dtype: torch.dtype  # the product dtype
    inter: int  # moe_inter_dim
    held: tuple  # weak references to every weight and scale they were made from


def experts(modules, x: torch.Tensor | fp8.Rounded, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype):
    """Expert j's output for each of its rows, the rows sorted by expert (``tokens`` the token of
    each, ``counts`` how many each expert has): (N k, D) in ``dtype``. None where the experts' own
    modules must run: an expert held by another rank, weights not kept (streamed, on a GPU,
    trained), or float32 weights (their copies would be the weights again)."""
    if isinstance(x, fp8.Rounded) and not fp8.sums_inexactly():
        return _in_kernel_order(modules, x, tokens, counts).to(dtype) if _fp8_kept(modules) else None
    prepared = _prepared(modules, dtype)
    if prepared is None:
        return None
    a = fast_fp8.values(x, prepared.dtype) if isinstance(x, fp8.Rounded) else x.to(prepared.dtype)
    a = products.gather(a, tokens)  # (N k, D)
    rows = a.split(counts)  # each expert's rows
    # an FP8 w2 reads its input rounded through FP8 (read here: the parts may run on helper threads)
    rounds = modules[0].w2.scale is not None and fp8.rounds_activations()
    scale_fmt = modules[0].w2.scale_fmt
    w = prepared

    def product(j: int, b: torch.Tensor, first: bool) -> torch.Tensor:
        packed = w.packed13 if first else w.packed2
        if packed is not None:
            return products.linear(b, None, packed[j])
        return F.linear(b, (w.w13 if first else w.w2)[j])

    def hidden(both: torch.Tensor) -> torch.Tensor:
        """silu(w1 x) * w3 x from [w1 x, w3 x], rounded as w2's input (rows independently)."""
        gate, up = both[:, : w.inter].to(dtype), both[:, w.inter :].to(dtype)
        h = (F.silu(gate.float()) * up.float()).to(dtype)
        return fast_fp8.values(fp8.Rounded.of(h, scale_fmt), w.dtype) if rounds else h.to(w.dtype)

    def part(chosen: list[int]) -> list[torch.Tensor]:
        both = torch.cat([product(j, rows[j], True) for j in chosen])  # (n, 2 inter): w1 x, w3 x
        split = hidden(both).split([counts[j] for j in chosen])
        return [product(j, b, False) for j, b in zip(chosen, split, strict=True)]

    used = [j for j, c in enumerate(counts) if c]
    per_row = a.shape[1] * 3 * w.inter  # multiply-adds of one row through an expert
    return torch.cat(spread(part, used, [counts[j] * per_row for j in used])).to(dtype)  # (N k, D)


def _fp8_kept(modules) -> bool:
    """Every expert here, with FP8 weights whose copies are kept."""
    return all(e is not None for e in modules) and modules[0].w1.scale is not None and weights.keeps(modules[0].w1.weight)


def _in_kernel_order(modules, x: fp8.Rounded, tokens: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """The experts' FP8 products in the kernel's block order (kernels.fp8.kernel_order), each
    expert's on its own rows as its modules form them, the block's rounded rows decoded once:
    (N k, D) in x's dtype."""
    rows = x.rows(tokens)  # (N k, D) codes and scales
    if rows.pow2:  # UE8M0: kernel_order multiplies the rows' values, decoded once (each expert's a slice)
        fast_fp8.values(rows, torch.float32)
    ends = list(itertools.accumulate(counts))
    scale_fmt = modules[0].w2.scale_fmt

    def product(lin, r: fp8.Rounded) -> torch.Tensor:
        return fast_fp8.kernel_order(r, lin.weight, lin.scale).to(x.dtype)

    def one(j: int) -> torch.Tensor:
        mine = rows[ends[j] - counts[j] : ends[j]]
        e = modules[j]
        gate, up = product(e.w1, mine), product(e.w3, mine)
        return product(e.w2, fp8.Rounded.of((F.silu(gate.float()) * up.float()).to(x.dtype), scale_fmt))

    used = [j for j, c in enumerate(counts) if c]
    if not used:
        return torch.zeros(0, modules[0].w2.weight.shape[0], dtype=x.dtype)
    per_row = rows.codes.shape[1] * 3 * modules[0].w1.weight.shape[0]  # multiply-adds of one row through an expert
    return torch.cat(spread(lambda chosen: [one(j) for j in chosen], used, [counts[j] * per_row for j in used]))


def _linears(modules) -> list | None:
    if any(e is None for e in modules):
        return None
    return [lin for e in modules for lin in (e.w1, e.w3, e.w2)]


def _prepared(modules, dtype: torch.dtype) -> ExpertWeights | None:
    linears = _linears(modules)
    if linears is None:
        return None
    first = linears[0].weight
    if not weights.keeps(first) or first.dtype == torch.float32:
        return None
    compute = products.product_dtype(dtype)
    held = tuple(t for lin in linears for t in (lin.weight, lin.scale))
    key = ("experts", compute, fp8.rounds_activations())  # the copies' rule differs by rounding (_whole_k)
    known = weights.get(first, key)
    if known is not weights.MISSING and _same(known.held, held):
        return known
    made = _prepare(linears, compute, held)
    if made is not None:
        weights.put(first, key, made)
    return made


def _same(refs: tuple, held: tuple) -> bool:
    return len(refs) == len(held) and all(r() is t for r, t in zip(refs, held, strict=True))


def _no_ref() -> None:
    return None


def _whole_k(lin) -> bool:
    """Whether this FP8 expert's product multiplies its weight dequantised in the product dtype:
    with rounded activations, inside model.fp8.inexact_sums only (whatever the scales); with
    unrounded ones, where its scales are powers of two (kernels.fp8.unrounded_gemm otherwise rounds
    the dequantised weight to the activations' dtype first)."""
    if fp8.rounds_activations():
        return fp8.sums_inexactly()
    return fast_fp8.exactly_dequantised(lin.scale)


def _copy(lin, compute: torch.dtype) -> torch.Tensor | None:
    """What one expert's product multiplies, in the product dtype; None where the experts' own
    modules must form it (:func:`_whole_k`)."""
    if lin.scale is None:
        return lin.weight.detach().to(compute)
    return fast_fp8.weight_dequant(lin.weight, lin.scale, compute) if _whole_k(lin) else None


def _prepare(linears: list, compute: torch.dtype, held: tuple) -> ExpertWeights | None:
    copies = []
    for lin in linears:
        copies.append(_copy(lin, compute))
        if copies[-1] is None:
            return None
    refs = tuple(weakref.ref(t) if t is not None else _no_ref for t in held)
    inter = copies[2].shape[-1]
    if compute == torch.bfloat16 and products.packed_products_agree():
        packed13 = [products.pack(torch.cat(copies[i : i + 2])) for i in range(0, len(copies), 3)]
        packed2 = [products.pack(copy) for copy in copies[2::3]]
        return ExpertWeights(None, None, packed13, packed2, compute, inter, refs)
    w13 = torch.stack([torch.cat(copies[i : i + 2]) for i in range(0, len(copies), 3)])  # (E, 2 inter, D)
    w2 = torch.stack(copies[2::3])  # (E, D, inter)
    return ExpertWeights(w13, w2, None, None, compute, inter, refs)
