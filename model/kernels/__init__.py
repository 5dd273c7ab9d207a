"""The backend: faster routes to the values of the plain functions the model calls (the CPU's, and a
CUDA device's for the FP8 functions).

The model computes the reference's forward in plain PyTorch (model/fp8.py holds the reference's
kernels that way) and reaches a product, an FP8 rounding or a top-k only through the functions
below. On the CPU each takes a faster route where this package has one, to the plain function's
value, bit for bit in bfloat16 on this CPU's own route (tests/model/test_kernels.py checks each
route against its plain function, and the traces of a model both ways):

- ``products``: the bfloat16 route (native on CPUs with bf16 units, else through float32), weights
  laid out for oneDNN, products threaded by their work;
- ``fp8``: FP8 codes decoded from their bits, FP8 weights dequantised once, the indexer's masked
  keys left uncomputed;
- ``moe``: a MoE block's experts prepared together, [w1; w3] as one product, split among threads;
- ``cuda``: on a CUDA device, the FP8 products, dequantisations and roundings without a host
  synchronisation per product (the scales' power-of-two question answered once per weight, the
  128-wide blocks batched, bfloat16 copies kept within a budget: :func:`set_copy_budget`);
- ``weights``: the copies kept beside their weights (weakly: they go when the weight goes);
- ``threads``: the thread policy, a context the entry points enter (:func:`serial_passes`);
- ``through``: inside model.fp8.straight_through, where autograd records, each function's value as
  above and a gradient past it (FP8 roundings passed straight through, selections held fixed).

``ANATOMY_KERNELS=plain`` switches every route off (read once per process); :func:`plain` does in
a context. On a device other than the CPU (and CUDA's for the FP8 functions), on a weight that is
trained, and with the routes off, each function is its plain one. Nothing here changes a
process-wide setting.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import fp8 as plain_fp8
from . import cuda as _cuda
from . import fp8 as _fp8
from . import moe as _moe
from . import products, switch, threads, through, weights
from .cuda import set_copy_budget
from .products import cpu_route, describe_route, native_bf16, product_dtype
from .switch import ENV, enabled, plain, setting
from .threads import serial_passes
from .weights import use_once


def _on(t: torch.Tensor) -> bool:
    """Whether a value on this tensor's device takes the CPU routes (not while it is trained: a
    kept copy holds no gradient)."""
    return t.device.type == "cpu" and enabled() and not (t.requires_grad and torch.is_grad_enabled())


def _fp8_route(t: torch.Tensor):
    """The module whose FP8 functions a value on this tensor's device takes: the CPU's
    (kernels.fp8), CUDA's (kernels.cuda), or model.fp8's plain ones (routes off, another device, a
    tensor trained)."""
    if _on(t):
        return _fp8
    if t.device.type == "cuda" and enabled() and not (t.requires_grad and torch.is_grad_enabled()):
        return _cuda
    return plain_fp8


def describe() -> dict[str, str]:
    """For ``info`` and the app: the backend, the bfloat16 route and the threads, one line each."""
    if not enabled():
        why = "switched off here" if switch.forced() else f"{ENV}={setting()}"
        return {
            "cpu_kernels": f"plain PyTorch ({why})",
            "cpu_products": "as torch forms them",
            "cpu_threads": "torch's threading",
        }
    ignored = setting() and setting().lower() not in ("plain", "cpu")
    line = "CPU routes (model.kernels)" + (f"; {ENV}={setting()!r} ignored: say plain" if ignored else "")
    return {"cpu_kernels": line, "cpu_products": describe_route(), "cpu_threads": threads.describe()}


# --- what the model calls ---------------------------------------------------------------------------


def linear(
    x: torch.Tensor | plain_fp8.Rounded, weight: torch.Tensor, scale: torch.Tensor | None = None, scale_fmt: str | None = None
) -> torch.Tensor:
    """y = x W^T, the reference's ``linear``: an FP8 weight's product rounds x through FP8 first
    (model.fp8.fp8_gemm; x may come rounded already), another weight multiplies x in x's dtype.
    Inside model.fp8.unrounded_activations an FP8 weight's product takes x unrounded."""
    source = x.source if isinstance(x, plain_fp8.Rounded) else x
    if through.records(source):  # the gradient of x unrounded times the dequantised weight
        return through.through(lambda: linear(x, weight, scale, scale_fmt), through.unrounded_product(weight, scale), source)
    if scale is not None:
        if not isinstance(x, plain_fp8.Rounded) and not plain_fp8.rounds_activations():
            return _fp8_route(weight).unrounded_gemm(x, weight, scale)
        return _fp8_route(weight).fp8_gemm(x, weight, scale, scale_fmt)
    if not _on(weight):
        return F.linear(x, weight.to(x.dtype))
    compute = product_dtype(x.dtype)
    w = weight if weight.dtype == compute else weights.kept(weight, ("copy", compute), lambda: weight.detach().to(compute))
    return products.linear(x.to(compute), w, _fp8.packed(weight, w, compute)).to(x.dtype)


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, keep: bool = True) -> torch.Tensor:
    """The weight in ``dtype``: an FP8 weight times its block scales (model.fp8.weight_dequant). ``keep``:
    the route keeps the copy beside the weight (for a weight read at every step; on a GPU within
    the budget of :func:`set_copy_budget`)."""
    if scale is None:
        return weight.to(dtype)
    route = _fp8_route(weight)
    if route is _cuda:
        return _cuda.weight_dequant(weight, scale, dtype, keep)
    if route is plain_fp8:
        return plain_fp8.weight_dequant(weight, scale, dtype)
    return _fp8.dequantized(weight, scale, dtype) if keep else _fp8.weight_dequant(weight, scale, dtype)


def fake_quant(x: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """x rounded through FP8 and back (model.fp8.fake_quant); x itself inside model.fp8.unrounded_activations."""
    if not plain_fp8.rounds_activations():
        return x
    if through.records(x):  # the round trip passes its gradient unchanged
        return through.through(lambda: fake_quant(x, scale_fmt), through.identity, x)
    return _fp8_route(x).fake_quant(x, scale_fmt)


def fp8_index(
    q: torch.Tensor,
    weights_: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    causal_from: int | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The indexer's scores (model.fp8.fp8_index). ``causal_from``: the scores get a prefill's causal mask
    added after (query m sees keys up to causal_from + m), so the CPU route may leave the masked
    ones at -inf uncomputed; ``q_scale``: q's act_quant scales, which spare it reading the codes.
    q and k unrounded (model.fp8.quantised inside unrounded_activations) take the plain function.
    The scores only choose keys: they carry no gradient (model.fp8.straight_through)."""
    if through.records(q, weights_, k):
        with torch.no_grad():
            return fp8_index(q, weights_, k, k_scale, causal_from, q_scale)
    if _on(q) and q.dtype == plain_fp8.FP8:
        return _fp8.fp8_index(q, weights_, k, k_scale, causal_from, q_scale)
    return plain_fp8.fp8_index(q, weights_, k, k_scale)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The indexer's Walsh-Hadamard rotation (model.fp8.hadamard); no gradient, as the scores it feeds."""
    if through.records(x):
        with torch.no_grad():
            return hadamard(x)
    return _fp8.hadamard(x) if _on(x) else plain_fp8.hadamard(x)


def topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along ``dim`` and their indices, best first; among equal values the
    lower index wins, as CUDA's top-k fills ties in index order (CPU top-k leaves ties unordered).
    Index scores tie often: the ReLU makes whole rows of exact zeros. A selection carries no
    gradient (model.fp8.straight_through): the values too are returned without one."""
    if through.records(x):
        with torch.no_grad():
            return topk(x, k, dim)
    if _on(x):
        values, indices = products.sort(x, dim)
    else:
        values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """torch.einsum (on the CPU: in products.product_dtype, threaded)."""
    if through.records(*operands):
        surrogate = through.plain(lambda *xs: torch.einsum(equation, *xs))
        return through.through(lambda: einsum(equation, *operands), surrogate, *operands)
    return products.einsum(equation, *operands) if _on(operands[0]) else torch.einsum(equation, *operands)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul (on the CPU: in products.product_dtype, threaded)."""
    if through.records(a, b):
        return through.through(lambda: matmul(a, b), through.plain(torch.matmul), a, b)
    return products.matmul(a, b) if _on(a) else torch.matmul(a, b)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index) (on the CPU: threaded by the values it writes)."""
    return products.gather(x, index) if _on(x) else x.index_select(0, index)


def experts(modules, x: torch.Tensor | plain_fp8.Rounded, tokens: torch.Tensor, counts: list[int], dtype: torch.dtype):
    """A MoE block's routed experts on their rows, sorted by expert: (N k, D) in ``dtype``, by the
    CPU route where it has one (moe.experts); None where the block's own loop must run (also where
    autograd records: each expert's products then pass the gradient, model.kernels.through). On a
    GPU the loop runs, each product by kernels.cuda, the experts' scales judged first with one
    synchronisation for all that are new (a streamed block's)."""
    if through.records(x.source if isinstance(x, plain_fp8.Rounded) else x):
        return None
    route = _fp8_route(tokens)
    if route is _cuda:
        _cuda.decide(_cuda.experts_scales(modules, counts))
    return _moe.experts(modules, x, tokens, counts, dtype) if route is _fp8 else None


__all__ = [
    "cpu_route",
    "describe",
    "einsum",
    "enabled",
    "experts",
    "fake_quant",
    "fp8_index",
    "gather",
    "hadamard",
    "linear",
    "matmul",
    "native_bf16",
    "plain",
    "product_dtype",
    "serial_passes",
    "set_copy_budget",
    "topk",
    "use_once",
    "weight_dequant",
]
