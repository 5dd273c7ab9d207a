"""Gradients past the routes (model.fp8.straight_through): a value computed as the forward computes
it, bit for bit, and a gradient from a plain differentiable function of the same inputs.

The routes form their values in ways autograd cannot follow (FP8 codes, integer views of scales,
products threaded into preallocated outputs) or follows into other values (a route chosen by
whether an input requires grad). :func:`through` keeps the value of the route and takes the
gradient of its surrogate: the unrounded product for an FP8 one (the straight-through
estimator), the identity for an FP8 round trip, torch's own product for a product route.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import fp8


class _Through(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: Callable[[], torch.Tensor], surrogate: Callable[..., torch.Tensor], *inputs: torch.Tensor):
        ctx.surrogate = surrogate
        # the inputs with a gradient are saved (autograd checks they stay as they were); the constants
        # (a weight's dequantised copy, kept since an inference-mode pass made it) are held as they are
        ctx.save_for_backward(*(x for x in inputs if x.requires_grad))
        ctx.constants = [None if x.requires_grad else x for x in inputs]
        out = value()  # grad mode is off here: the route the forward takes without autograd
        # a view (a product's permuted result) or an input is copied: later in-place ops must see a tensor of its own
        return out.clone() if out._is_view() or any(out is x for x in inputs) else out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved).detach().requires_grad_() if x is None else x for x in ctx.constants]
        wanted = [x for x in inputs if x.requires_grad]
        with torch.enable_grad():
            out = ctx.surrogate(*inputs)
            grads = iter(torch.autograd.grad(out, wanted, grad.to(out.dtype), allow_unused=True))
        return (None, None, *(next(grads) if x.requires_grad else None for x in inputs))


def through(value: Callable[[], torch.Tensor], surrogate: Callable[..., torch.Tensor], *inputs: torch.Tensor) -> torch.Tensor:
    """``value()`` (computed without autograd), whose gradient with respect to ``inputs`` is
    ``surrogate(*inputs)``'s."""
    return _Through.apply(value, surrogate, *inputs)


def records(*inputs: torch.Tensor | None) -> bool:
    """Whether autograd records a function of these inputs here, inside model.fp8.straight_through."""
    return fp8.passes_straight_through() and torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in inputs)


def unrounded_product(weight: torch.Tensor, scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x W^T in float32 with x as it is and W dequantised: the FP8 product's straight-through surrogate
    (the activations' rounding passed as the identity), a plain product's own."""

    def product(x: torch.Tensor) -> torch.Tensor:
        w = weight.float() if scale is None else fp8.weight_dequant(weight, scale, torch.float32)
        return torch.nn.functional.linear(x.float(), w)

    return product


def identity(x: torch.Tensor) -> torch.Tensor:
    return x


def plain(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` on float32 copies of its operands: a product's surrogate, its gradient unrounded."""
    return lambda *xs: fn(*(x.float() for x in xs))
