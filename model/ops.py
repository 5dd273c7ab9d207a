"""Small numerical helpers shared by the layers, and the one decision of how the CPU multiplies
bfloat16.

A bfloat16 product accumulates in float32 and rounds once, on a GPU and in the reference's kernels.
On a CPU that has bf16 units (AVX512-BF16, AMX) oneDNN does the same, 2-3x faster than the float32
route; a CPU without them multiplies bfloat16 5-100x slower, so there the operands go to float32
(exactly) and the float32 product is rounded once. Both routes round each output once from a
float32 sum; they differ only in the order the sum is formed, which moves about 2 in 10,000
outputs by one bfloat16 unit. ``ANATOMY_CPU_BF16`` (``native`` | ``float32``) overrides the choice.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch

_LOW = (torch.bfloat16, torch.float16)
_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("native_bf16", default=None)
ROUTE_ENV = "ANATOMY_CPU_BF16"


@functools.lru_cache(maxsize=1)
def has_bf16_units() -> bool:
    """Whether this CPU multiplies bfloat16 natively (what oneDNN reports)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def native_bf16() -> bool:
    """Whether CPU products of bfloat16 activations are formed in bfloat16 (else in float32)."""
    forced = _FORCED.get()
    if forced is not None:
        return forced
    setting = os.environ.get(ROUTE_ENV, "").strip().lower()
    if setting in ("native", "bf16", "bfloat16"):
        return True
    if setting in ("float32", "f32", "fp32"):
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


def describe_cpu_route() -> str:
    """One line for ``info`` and the app: which route, and why."""
    units = "has bf16 units" if has_bf16_units() else "has no bf16 units"
    setting = os.environ.get(ROUTE_ENV, "").strip()
    known = setting.lower() in ("native", "bf16", "bfloat16", "float32", "f32", "fp32")
    why = f"{ROUTE_ENV}={setting}" if known else f"this CPU {units}"
    if setting and not known:
        why += f"; {ROUTE_ENV}={setting!r} ignored: say native or float32"
    route = "native bfloat16" if native_bf16() else "float32, rounded once"
    return f"{route} ({why})"


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU product of ``dtype`` activations is formed in."""
    if dtype == torch.bfloat16 and native_bf16():
        return torch.bfloat16
    return torch.float32 if dtype in _LOW else dtype


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """torch.einsum, on the CPU in :func:`product_dtype`, rounded back to the operands' dtype."""
    dtype = operands[0].dtype
    if operands[0].device.type == "cpu" and dtype in _LOW:
        compute = product_dtype(dtype)
        return torch.einsum(equation, *(x.to(compute) for x in operands)).to(dtype)
    return torch.einsum(equation, *operands)


def topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along ``dim`` and their indices, best first; among equal values the
    lower index wins, as CUDA's top-k fills ties in index order (CPU top-k leaves ties unordered).
    Index scores tie often: the ReLU makes whole rows of exact zeros."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
