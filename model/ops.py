"""Small numerical helpers shared by the layers, and the one decision of how the CPU multiplies
bfloat16.

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

Threads: an idle OpenMP thread sleeps (``OMP_WAIT_POLICY=PASSIVE``, see ``model/__init__.py``), and
waking it costs more than most of a forward's passes gain from it: on a 2-core machine a 128-token
prefill ran 15% and a decode step 27% faster with the norms, roundings, RoPE and small products on
one thread. So a CPU forward runs its passes on one thread (:func:`serial_passes`) and hands to
every thread only products of at least :func:`parallel_work` multiply-adds and passes worth as
much (:func:`threaded`, :func:`gather`), and a MoE block's experts in parts on helper threads
(:func:`spread`). In bfloat16 which thread forms an output does not change how it is summed (tests
check every recorded value bit for bit, on both routes); a float32 product of a few rows can round
differently on one thread than on two (the BLAS splits its sums by thread), as it did between
machines with different thread counts.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

_LOW = (torch.bfloat16, torch.float16)
_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("native_bf16", default=None)
ROUTE_ENV = "ANATOMY_CPU_BF16"
NATIVE_SETTINGS = ("native", "bf16", "bfloat16")  # the values of ROUTE_ENV that choose each route
FLOAT32_SETTINGS = ("float32", "f32", "fp32")
PARALLEL_ENV = "ANATOMY_PARALLEL_WORK"
# multiply-adds from which a product uses every thread: on a 2-core EPYC a one-row product of a
# 1024 x 2816 bfloat16 weight (2.9M) gains from the second thread only when that thread is awake
_PARALLEL_WORK = 1 << 22
# what a pass over one value counts as, in multiply-adds: gathers of 3M values ran faster on two
# threads there, of 0.8M on one (a fresh buffer's pages are faulted in by the thread that writes them)
VALUE_WORK = 2
_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("serial_threads", default=0)


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


def describe_cpu_route() -> str:
    """One line for ``info`` and the app: which route, and why."""
    units = "has bf16 units" if has_bf16_units() else "has no bf16 units"
    setting = route_setting()
    known = setting.lower() in NATIVE_SETTINGS + FLOAT32_SETTINGS
    why = f"{ROUTE_ENV}={setting}" if known else f"this CPU {units}"
    if setting and not known:
        why += f"; {ROUTE_ENV}={setting!r} ignored: say native or float32"
    route = "native bfloat16" if native_bf16() else "float32, rounded once"
    return f"{route} ({why})"


@functools.lru_cache(maxsize=1)
def parallel_work() -> int:
    """Multiply-adds from which a product inside :func:`serial_passes` runs on every thread;
    ``ANATOMY_PARALLEL_WORK`` overrides (0: every pass on every thread, as torch does)."""
    setting = os.environ.get(PARALLEL_ENV, "").strip()
    try:
        return max(0, int(float(setting))) if setting else _PARALLEL_WORK
    except ValueError:
        return _PARALLEL_WORK


@contextlib.contextmanager
def serial_passes(device: torch.device):
    """Run this context's CPU passes on one thread, products of :func:`threaded` on all of them.
    A no-op on other devices, with one thread, when nested, or with ``ANATOMY_PARALLEL_WORK=0``."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1 or _THREADS.get() or not parallel_work():
        yield
        return
    token = _THREADS.set(threads)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        _THREADS.reset(token)


def threaded(work: int, product, *args, **kwargs):
    """``product(*args, **kwargs)``, on every thread where ``work`` (its multiply-adds) is at least
    :func:`parallel_work` inside :func:`serial_passes`; else where it is called."""
    threads = _THREADS.get()
    if threads < 2 or work < parallel_work():  # 1: a part of ops.spread, on its own thread
        return product(*args, **kwargs)
    torch.set_num_threads(threads)
    try:
        return product(*args, **kwargs)
    finally:
        torch.set_num_threads(1)


def spread(run, items: list, work: list[int]) -> list:
    """``run(part)`` for contiguous parts of ``items``, one part per thread, concatenated in order:
    inside :func:`serial_passes`, when the items' ``work`` adds up to :func:`parallel_work`, the
    parts run at once on helper threads, each product on one thread (a MoE block's experts: one
    hand-off per block instead of a thread wake-up in every expert's products). Else
    ``run(items)``."""
    threads, total = _THREADS.get(), sum(work)
    if threads < 2 or len(items) < 2 or total < parallel_work():
        return run(items)
    parts, start, done = [], 0, 0
    for i, w in enumerate(work):  # cut where the running work passes each thread's share
        done += w
        if done * threads >= total * (len(parts) + 1) and i + 1 < len(items) and len(parts) < threads - 1:
            parts.append(items[start : i + 1])
            start = i + 1
    parts.append(items[start:])
    token = _THREADS.set(1)  # this thread's part runs serially too
    try:
        futures = [_helpers(threads - 1).submit(run, part) for part in parts[1:]]
        first = run(parts[0])
        return first + [out for f in futures for out in f.result()]
    finally:
        _THREADS.reset(token)


@functools.lru_cache(maxsize=4)
def _helpers(n: int) -> ThreadPoolExecutor:
    """Helper threads for :func:`spread`, each multiplying on one thread."""
    return ThreadPoolExecutor(n, thread_name_prefix="anatomy-spread", initializer=torch.set_num_threads, initargs=(1,))


os.register_at_fork(after_in_child=_helpers.cache_clear)  # a forked child has none of the parent's threads


def gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x.index_select(0, index), threaded by the values it writes."""
    return threaded(index.numel() * x[0].numel() * VALUE_WORK, torch.index_select, x, 0, index)


def describe_threads() -> str:
    """One line for ``info`` and the app: how a CPU forward uses its threads."""
    threads, work = torch.get_num_threads(), parallel_work()
    if threads == 1:
        return "1 thread"
    if not work:
        return f"{threads} threads for every pass ({PARALLEL_ENV}=0)"
    return f"{threads} threads for products of at least {work:,} multiply-adds, 1 for the rest ({PARALLEL_ENV} overrides)"


def product_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a CPU product of ``dtype`` activations is formed in."""
    if dtype == torch.bfloat16 and native_bf16():
        return torch.bfloat16
    return torch.float32 if dtype in _LOW else dtype


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
    """torch.einsum, on the CPU in :func:`product_dtype`, rounded back to the operands' dtype."""
    return _formed(functools.partial(torch.einsum, equation), einsum_work(equation, *operands), *operands)


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
    """torch.matmul, as :func:`einsum` forms it (for the decode step's small products, where
    einsum's own reshaping costs more than the product)."""
    return _formed(torch.matmul, a.numel() * b.shape[-1], a, b)


def _formed(product, work: int, *operands: torch.Tensor) -> torch.Tensor:
    dtype = operands[0].dtype
    if operands[0].device.type == "cpu" and dtype in _LOW:
        compute = product_dtype(dtype)
        return threaded(work, product, *(x.to(compute) for x in operands)).to(dtype)
    return threaded(work, product, *operands)


def topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along ``dim`` and their indices, best first; among equal values the
    lower index wins, as CUDA's top-k fills ties in index order (CPU top-k leaves ties unordered).
    Index scores tie often: the ReLU makes whole rows of exact zeros."""
    work = x.numel() * max(1, x.shape[dim]).bit_length() * VALUE_WORK
    values, indices = threaded(work, torch.sort, x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
