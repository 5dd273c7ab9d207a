"""How the CPU multiplies: the bfloat16 route, weights laid out for oneDNN, threaded products.

A bfloat16 product accumulates in float32 and rounds once, on a GPU and in the reference's kernels.
On a CPU that has bf16 units (AVX512-BF16, AMX) oneDNN does the same, 2-3x faster than the float32
route; a CPU without them multiplies bfloat16 5-100x slower, so there the operands go to float32
(exactly) and the float32 product is rounded once. Both routes round each output once from a
float32 sum; they differ only in the order the sum is formed, which moves about 2 in 10,000
outputs by one bfloat16 unit. ``ANATOMY_CPU_BF16`` (``native`` | ``float32``) overrides the choice;
it is read once per process (:func:`route_setting`), and :func:`cpu_route` forces either route in a
context.

Where oneDNN multiplies bfloat16 natively, a weight laid out once for it (:func:`pack`) skips the
per-call reordering: 2.5x faster for one row, 5-15% for hundreds. It is used only where it gives
``F.linear``'s bits, checked once per process (:func:`packed_products_agree`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
import torch.nn.functional as F

from .threads import VALUE_WORK, threaded

LOW = (torch.bfloat16, torch.float16)
_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("native_bf16", default=None)
ROUTE_ENV = "ANATOMY_CPU_BF16"
NATIVE_SETTINGS = ("native", "bf16", "bfloat16")  # the values of ROUTE_ENV that choose each route
FLOAT32_SETTINGS = ("float32", "f32", "fp32")


@functools.lru_cache(maxsize=1)
def has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 natively (what oneDNN reports)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def route_setting() -> str:
    """``ANATOMY_CPU_BF16`` as this process found it (read once: products ask at every call;
    ``route_setting.cache_clear()`` reads it again)."""
    return os.environ.get(ROUTE_ENV, "").strip()


def native_bf16() -> bool:
    """Whether CPU products of bfloat16 activations are formed in bfloat16 (else in float32)."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    setting = route_setting().lower()
    if setting in NATIVE_SETTINGS:
        return True
    if setting in FLOAT32_SETTINGS:
        return False
    return has_bf16_units()


@contextlib.contextmanager
def cpu_route(native: bool):
    """Force the CPU route in this context (benchmarks and tests compare both in one process)."""
    token = _FORCED.set(native)
    try:
        yield
    finally:
        _FORCED.reset(token)


def describe_route() -> str:
    """One line for ``info`` and the app: which route, and why."""
    units = "has bf16 units" if has_bf16_units() else "has no bf16 units"
    setting = route_setting()
    known = setting.lower() in NATIVE_SETTINGS + FLOAT32_SETTINGS
    why = f"{ROUTE_ENV}={setting}" if known else f"this CPU {units}"
    if setting and not known:
        why += f"; {ROUTE_ENV}={setting!r} ignored: say native or float32"
    route = "native bfloat16" if native_bf16() else "float32, rounded once"
    return f"{route} ({why})"


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU product of ``dtype`` activations is formed in."""
    if dtype == torch.bfloat16 and native_bf16():
        return torch.bfloat16
    return torch.float32 if dtype in LOW else dtype


@functools.lru_cache(maxsize=1)
def packed_products_agree() -> bool:
    """Whether bfloat16 products through weights prepacked for oneDNN give ``F.linear``'s bits on this
    machine: tried once on a few shapes (rows 1 to 300, a partial 128-block, a strided input)."""
    try:
        reorder, product = torch.ops.mkldnn._reorder_linear_weight, torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return False
        gen = torch.Generator().manual_seed(0)
        for rows, k, n in ((1, 256, 320), (3, 512, 128), (17, 384, 1024), (64, 1024, 256), (300, 128, 576)):
            weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
            x = torch.randn(2, rows, 2 * k, generator=gen).to(torch.bfloat16)[..., ::2]
            if not torch.equal(product(x, reorder(weight, None), None, "none", [], ""), F.linear(x, weight)):
                return False
        return True
    except (AttributeError, RuntimeError, TypeError):  # no oneDNN in this build, or these ops changed
        return False


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (N, K) laid out once for oneDNN's bfloat16 product (see :func:`linear`); None where
    that is not the same product: not bfloat16, not on the CPU, or not the same bits here."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or not packed_products_agree():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T, through ``packed`` (:func:`pack` of ``weight``; then ``weight`` may be None) when given:
    the same bits, faster."""
    work = x.numel() * (packed if weight is None else weight).shape[0]
    if packed is None:
        return threaded(work, F.linear, x, weight)
    return threaded(work, torch.ops.mkldnn._linear_pointwise, x, packed, None, "none", [], "")


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """torch.einsum in :func:`product_dtype`, rounded back to the operands' dtype."""
    return formed(functools.partial(torch.einsum, equation), einsum_work(equation, *operands), *operands)


def einsum_work(equation: str, *operands: torch.Tensor) -> int:
    """The multiply-adds of an einsum: the product of the sizes of every index it names."""
    sizes: dict[str, int] = {}
    for names, x in zip(equation.split("->")[0].split(","), operands, strict=True):
        sizes.update(zip(names.strip(), x.shape, strict=True))
    work = 1
    for size in sizes.values():
        work *= size
    return work


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.matmul, as :func:`einsum` forms it."""
    return formed(torch.matmul, a.numel() * b.shape[-1], a, b)


def formed(product, work: int, *operands: torch.Tensor) -> torch.Tensor:
    """``product(*operands)`` in :func:`product_dtype`, rounded back to the operands' dtype, threaded by ``work``."""
    dtype = operands[0].dtype
    if dtype in LOW:
        compute = product_dtype(dtype)
        return threaded(work, product, *(x.to(compute) for x in operands)).to(dtype)
    return threaded(work, product, *operands)


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index), threaded by the values it writes."""
    return threaded(index.numel() * x[0].numel() * VALUE_WORK, torch.index_select, x, 0, index)


def sort(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The stable descending sort behind top-k, threaded by its work."""
    work = x.numel() * max(1, x.shape[dim]).bit_length() * VALUE_WORK
    return threaded(work, torch.sort, x, dim=dim, descending=True, stable=True)
