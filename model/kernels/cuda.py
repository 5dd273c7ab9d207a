"""FP8 products on a GPU: model.fp8's values, the 128-wide blocks batched into one product per chunk
of rows, no float32 copy of a weight, and no host synchronisation per product.

The plain ``fp8_gemm`` widens the whole weight to float32 for every product and issues a product,
a scale product and an add per 128-wide block of K (a Python loop of several launches each). The
shortcut of power-of-two scales (the dequantised operands' partials are the scaled ones) needs to
know the weight's scales are such: asking (``fp8.is_pow2``) copies a flag to the host, which waits
for the GPU. Here:

- that question is answered once per scale tensor and kept with it (:func:`pow2_scales`;
  :func:`decide` answers many with one synchronisation: a MoE block's experts, a model loaded;
  :func:`decide_from_host` none, from the host copy a loader holds);
- the blocks' partial products are one batched product, (K/128, M, 128) x (K/128, 128, N), in rows
  chunked to bound the float32 partials (:data:`PARTIALS_BYTES`), from bfloat16 operands (FP8 codes
  are exact in bfloat16, and so are the dequantised values where the scales are powers of two),
  each partial formed in float32 (cuBLAS's bfloat16 product with a float32 output);
- the partials are scaled as the kernel scales them and added to the float32 sum block after block,
  in the kernel's order (the same additions as model.fp8.blockwise, never a tree sum);
- a weight's bfloat16 copy is kept beside it for the weights read at every step, within a budget of
  device bytes (:func:`set_copy_budget`; none by default), and made per product otherwise: never a
  float32 copy of a whole weight.

Every function runs on any device: on the CPU (where the tests run it) the partials come from a
float32 product of the same exact operands, rows padded as model.fp8.padded_rows pads them, so they
are model.fp8's bit for bit (tests/model/test_cuda_route.py). The dispatcher (model.kernels) takes
these for tensors on a CUDA device.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary

from .. import fp8
from ..fp8 import BLOCK, FP8, Rounded
from . import fp8 as routes
from . import weights

PARTIALS_BYTES = 64 << 20  # bound on one chunk's float32 block partials (as much again for their scales)
_OPERAND = torch.bfloat16  # exact for FP8 codes, and for their values times power-of-two scales


# --- the power-of-two question, once per scale tensor -------------------------------------------------


def pow2_scales(scale: torch.Tensor) -> bool:
    """fp8.is_pow2 of a weight's scales, worked out once per scale tensor (one synchronisation
    the first time, none after) and kept with it."""
    if scale.is_meta:  # no values (tracing.plan counts allocations there): the general route's
        return False
    return weights.decided(scale, ("pow2",), lambda: fp8.is_pow2(scale))


def decide(scales: Sequence[torch.Tensor]) -> int:
    """Work out :func:`pow2_scales` of every scale tensor not known yet with one device-to-host
    copy for them all (a block's experts, a model just loaded): how many were worked out."""
    unknown = [s for s in scales if not s.is_meta and weights.known(s, ("pow2",)) is weights.MISSING]
    if not unknown:
        return 0
    flags = torch.stack([(fp8._pow2_ceil(s.float().abs()) == s).all() for s in unknown]).tolist()  # the one copy
    for s, flag in zip(unknown, flags, strict=True):
        weights.remember(s, ("pow2",), bool(flag))
    return len(unknown)


def decide_from_host(scale: torch.Tensor, host: torch.Tensor) -> None:
    """Record :func:`pow2_scales` of a device ``scale`` from the host tensor it was copied from
    (no device synchronisation: a loader that still holds the host copy)."""
    weights.remember(scale, ("pow2",), fp8.is_pow2(host))


# --- copies kept beside their weights, within a budget of device bytes --------------------------------


class _Budget:
    """Bytes of bfloat16 copies kept beside device weights, and the most there may be."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.limit = 0
        self.held = 0
        self.sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> {key: bytes}

    def release(self, sizes: dict) -> None:
        with self.lock:
            self.held -= sum(sizes.values())
            sizes.clear()


_BUDGET = _Budget()


def set_copy_budget(nbytes: int) -> None:
    """Keep bfloat16 copies of device weights (dequantised, or the codes widened) up to ``nbytes``
    in all, first come first kept (the weights read at every step are the first read); 0 keeps
    none. Copies kept already stay until their weight goes. The CPU's copies are not counted here."""
    if nbytes < 0:
        raise ValueError(f"copy budget must be >= 0 bytes, got {nbytes}")
    with _BUDGET.lock:
        _BUDGET.limit = int(nbytes)


def copy_bytes() -> tuple[int, int]:
    """(bytes of device copies kept now, the budget)."""
    with _BUDGET.lock:
        return _BUDGET.held, _BUDGET.limit


def budgeted(weight: torch.Tensor) -> bool:
    """Whether copies of ``weight`` count against the budget: a device's (the CPU's host memory is
    the CPU routes' to keep, as kernels.fp8 keeps its copies)."""
    return weight.device.type != "cpu"


def _kept(weight: torch.Tensor, key: Hashable, make: Callable[[], torch.Tensor], depends=(), keep: bool = True) -> torch.Tensor:
    """``make()``, kept with ``weight`` where copies of it may be kept: on the CPU always (the tests'
    device), elsewhere while the budget holds it."""
    if not keep or not weights.keeps(weight):
        return make()
    value = weights.get(weight, key, depends)
    if value is not weights.MISSING:
        return value
    value = make()
    if not budgeted(weight):
        weights.put(weight, key, value, depends)
        return value
    with _BUDGET.lock:
        sizes = _BUDGET.sizes.get(weight)
        old = sizes.get(key, 0) if sizes is not None else 0
        if _BUDGET.held - old + value.nbytes > _BUDGET.limit:
            return value
        if sizes is None:
            sizes = _BUDGET.sizes[weight] = {}
            weakref.finalize(weight, _BUDGET.release, sizes)
        _BUDGET.held += value.nbytes - old
        sizes[key] = value.nbytes
    weights.put(weight, key, value, depends)
    return value


# --- values ------------------------------------------------------------------------------------------


def values(r: Rounded, dtype: torch.dtype) -> torch.Tensor:
    """Rounded.values(dtype) through torch's conversion (kernels.fp8.converted: formed in ``dtype``
    directly where the scales are powers of two, no read back to the host); once per dtype."""
    return routes.values(r, dtype, routes.converted)


def fake_quant(x: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """model.fp8.fake_quant, decoded as :func:`values`."""
    return routes.fake_quant(x, scale_fmt, routes.converted)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """model.fp8.weight_dequant, bit for bit, in chunks of rows (each code times its block's scale
    in float32, rounded to ``dtype``; in ``dtype`` directly where the scales are powers of two): no
    float32 copy of the whole weight, no scale expanded to its size."""
    fp8.check_scale_shape(weight.shape, scale.shape)
    n, k = weight.shape
    if k % BLOCK:  # a partial column block: the plain function's expansion
        return fp8.weight_dequant(weight, scale, dtype)
    form = dtype if dtype in (torch.bfloat16, torch.float32) and pow2_scales(scale) else torch.float32
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    rows = max(BLOCK, PARTIALS_BYTES // (4 * k) // BLOCK * BLOCK)  # whole row blocks per chunk
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        s = scale[start // BLOCK : -(-stop // BLOCK)].repeat_interleave(BLOCK, 0)[: stop - start]  # (rows, K/128)
        w = weight[start:stop].to(form).reshape(stop - start, k // BLOCK, BLOCK)
        out[start:stop] = (w * s.to(form).unsqueeze(-1)).reshape(stop - start, k)
    return out


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, keep: bool = True) -> torch.Tensor:
    """model.fp8.weight_dequant; kept with the weight (``keep``, within the budget)."""
    return _kept(weight, ("dequantized", dtype), lambda: dequantize(weight, scale, dtype), (scale,), keep)


# --- products ----------------------------------------------------------------------------------------


def unrounded_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """model.fp8.unrounded_gemm: the same product of x and the weight dequantised to x's dtype
    (kept within the budget)."""
    form = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return F.linear(x.to(form), weight_dequant(weight, scale, x.dtype).to(form)).to(x.dtype)


def fp8_gemm(x: torch.Tensor | Rounded, weight: torch.Tensor, scale: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """model.fp8.fp8_gemm: act_quant(x) times the FP8 weight in the kernel's block order
    (:func:`kernel_order`); inside model.fp8.inexact_sums the dequantised operands over the whole K."""
    r = x if isinstance(x, Rounded) else Rounded.of(x, scale_fmt)
    *lead, k = r.codes.shape
    if fp8.sums_inexactly():
        form = r.dtype if r.dtype in (torch.bfloat16, torch.float32) else torch.float32
        return F.linear(values(r, form), weight_dequant(weight, scale, form)).to(r.dtype)
    return kernel_order(r.flat(), weight, scale).to(r.dtype).reshape(*lead, -1)


def kernel_order(r: Rounded, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """model.fp8.blockwise of rounded rows ``r`` (M, K) and an FP8 weight (N, K): (M, N) float32.

    With power-of-two weight scales the blocks multiply the weight dequantised (its bfloat16 copy:
    exact), and a block's partial times the activations' scale is the codes' partial times both
    scales, exactly (the weight's scale is a power of two, so both products round the same real
    number once); with power-of-two activation scales too (``r.pow2``) the rows' values are
    multiplied and no scale is applied. Otherwise the codes are multiplied and each partial scaled
    by (activation scale x weight scale), as the kernel does. (No value here comes near float32's
    range ends, where scaling by a power of two would round.)"""
    m, k = r.codes.shape
    n, kb = weight.shape[0], k // BLOCK
    if pow2_scales(scale):
        b = weight_dequant(weight, scale, _OPERAND)  # (N, K): exact
        a = values(r, _OPERAND) if r.pow2 else r.codes
        scaled = None if r.pow2 else (r.scale, None)
    else:
        b = _kept(weight, ("codes", _OPERAND), lambda: weight.to(_OPERAND))  # (N, K): the codes, exact
        a = r.codes
        scaled = (r.scale, scale.repeat_interleave(BLOCK, 0)[:n].t())  # (M, K/128), (K/128, N)
    b = _operand(b.reshape(n, kb, BLOCK).permute(1, 2, 0))  # (K/128, 128, N)
    out = torch.zeros(m, n, dtype=torch.float32, device=r.codes.device)
    per_row = kb * n * 4 * (1 if scaled is None else 2)  # a row's partials, and their scales
    rows = max(1, PARTIALS_BYTES // per_row)
    for start in range(0, m, rows):
        stop = min(start + rows, m)
        chunk = a[start:stop].to(_OPERAND).reshape(stop - start, kb, BLOCK).transpose(0, 1)  # (K/128, rows, 128)
        partials = block_partials(chunk, b)  # (K/128, rows, N) float32
        if scaled is not None:
            a_scale, b_scale = scaled
            s = a_scale[start:stop].t().unsqueeze(-1)  # (K/128, rows, 1)
            partials.mul_(s if b_scale is None else s * b_scale.unsqueeze(1))  # the scale product first, as the kernel
        sums = out[start:stop]
        for j in range(1 if r.codes.is_meta else kb):  # block after block, into the float32 sum
            sums += partials[j]
    return out


def _operand(b: torch.Tensor) -> torch.Tensor:
    """The weight's operand for :func:`block_partials`: as it is where the device multiplies
    bfloat16 into float32, widened to float32 (exact) on the CPU."""
    return b.float() if b.device.type == "cpu" or not _bf16_into_float32(b.device.type) else b


def block_partials(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(K/128, M, 128) x (K/128, 128, N) -> (K/128, M, N): each 128-wide block's partial product in
    float32 (each term exact). On a GPU cuBLAS's bfloat16 product with a float32 output, summed as
    cuBLAS sums; on the CPU the float32 product of the operands widened, its rows padded to
    model.fp8.IN_ORDER_ROWS, where the BLAS sums each dot product in order (checked once per
    thread count: :func:`batched_sums_in_order`; one block at a time by model.fp8.block_product
    otherwise)."""
    if a.device.type != "cpu":
        if b.dtype == torch.float32:  # this torch cannot write a bfloat16 product in float32
            return torch.bmm(a.float(), b)
        return torch.bmm(a, b, out_dtype=torch.float32)
    m = a.shape[1]
    a = a.float()
    if m < fp8.IN_ORDER_ROWS:
        a = torch.cat([a, a.new_zeros(a.shape[0], fp8.IN_ORDER_ROWS - m, a.shape[2])], 1)
    if batched_sums_in_order():
        return torch.bmm(a, b)[:, :m]
    return torch.stack([fp8.block_product(a[j], b[j].t())[:m] for j in range(a.shape[0])])


@functools.lru_cache(maxsize=4)
def _bf16_into_float32(device_type: str) -> bool:
    """Whether torch multiplies bfloat16 into a float32 output on this device (torch.bmm's
    ``out_dtype``: CUDA, torch 2.8 and later)."""
    try:
        a = torch.zeros(1, 1, BLOCK, dtype=torch.bfloat16, device=device_type)
        torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def batched_sums_in_order() -> bool:
    """Whether this CPU's batched float32 product, laid out as :func:`kernel_order` lays it out,
    sums each 128-term dot product in order (model.fp8.in_order) at the calling thread's count."""
    return _batched_in_order(torch.get_num_threads())


@functools.lru_cache(maxsize=16)
def _batched_in_order(threads: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    codes = codes[~codes.isnan()]
    for rows, n, kb in ((fp8.IN_ORDER_ROWS, 256, 3), (fp8.IN_ORDER_ROWS + 1, 128, 2), (33, 576, 2)):
        a = codes[torch.randint(0, len(codes), (kb, rows, BLOCK), generator=gen)]
        w = codes[torch.randint(0, len(codes), (n, kb * BLOCK), generator=gen)]
        b = w.view(n, kb, BLOCK).permute(1, 2, 0)  # (K/128, 128, N), as kernel_order's
        want = torch.stack([fp8.in_order(a[j], w[:, j * BLOCK : (j + 1) * BLOCK]) for j in range(kb)])
        if not torch.equal(torch.bmm(a, b), want):
            return False
    return True


def experts_scales(modules, counts: Sequence[int]) -> list[torch.Tensor]:
    """The FP8 scales of the MoE block's experts held here that have rows (``counts``) in this pass
    (for :func:`decide`)."""
    chosen = (e for e, c in zip(modules, counts, strict=True) if c and e is not None)
    return [lin.scale for e in chosen for lin in (e.w1, e.w3, e.w2) if lin.scale is not None]
