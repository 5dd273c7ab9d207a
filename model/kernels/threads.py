"""How a CPU forward uses its threads, set for the calling OS thread only.

An idle OpenMP thread sleeps (where the entry point started torch with ``OMP_WAIT_POLICY=PASSIVE``:
:func:`tracing.startup.load_torch`), and waking it costs more than most of a forward's passes gain
from it: on a 2-core machine a 128-token prefill ran 15% and a decode step 27% faster with the
norms, roundings, RoPE and small products on one thread. Inside :func:`serial_passes` (which the
entry points enter: the command line, ``tracing.run``, the app, the benchmarks) a CPU forward runs
its passes on one thread and hands to every thread only products of at least
:func:`parallel_work` multiply-adds and passes worth as much (:func:`threaded`), and a MoE block's
experts in parts on helper threads (:func:`spread`).

Only this thread's settings change: OpenMP's thread count is a per-thread setting (its ICV), and
MKL has one too (``MKL_Set_Num_Threads_Local``); ``torch.set_num_threads`` is never called, since
it also sets the count every new thread starts from and MKL's count for the whole process. So two
threads tracing at once (two app sessions) leave each other's thread counts, and so their float32
roundings, alone. Where the OpenMP runtime is not found (not libgomp), the context does nothing.

In bfloat16 which thread forms an output does not change how it is summed; a float32 product of a
few rows can round differently on one thread than on two (the BLAS splits its sums by thread).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from . import switch

PARALLEL_ENV = "ANATOMY_PARALLEL_WORK"
# multiply-adds from which a product uses every thread: on a 2-core EPYC a one-row product of a
# 1024 x 2816 bfloat16 weight (2.9M) gains from the second thread only when that thread is awake
DEFAULT_WORK = 1 << 22
# what a pass over one value counts as, in multiply-adds: gathers of 3M values ran faster on two
# threads there, of 0.8M on one (a fresh buffer's pages are faulted in by the thread that writes them)
VALUE_WORK = 2
_THREADS: contextvars.ContextVar[int] = contextvars.ContextVar("serial_threads", default=0)


class _Runtime:
    """This process's OpenMP and MKL per-thread setters, found among the libraries torch loaded."""

    def __init__(self) -> None:
        self.omp_set = self.omp_get = self.mkl_set = None
        for path in _loaded_libraries():
            name = os.path.basename(path)
            if self.omp_set is None and name.startswith("libgomp"):
                lib = _open(path)
                if lib is not None:
                    self.omp_set, self.omp_get = lib.omp_set_num_threads, lib.omp_get_max_threads
            if self.mkl_set is None and name.startswith(("libtorch_cpu", "libmkl_rt")):
                lib = _open(path)
                setter = getattr(lib, "MKL_Set_Num_Threads_Local", None) if lib is not None else None
                if setter is not None:  # the C interface, by value (the lowercase name is Fortran's, by pointer)
                    setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
                    self.mkl_set = setter
        if self.omp_set is not None:
            self.omp_set.argtypes, self.omp_set.restype = [ctypes.c_int], None
            self.omp_get.argtypes, self.omp_get.restype = [], ctypes.c_int

    @property
    def available(self) -> bool:
        return self.omp_set is not None

    def set(self, n: int) -> int | None:
        """This thread's OpenMP and MKL thread counts; returns MKL's previous per-thread setting."""
        self.omp_set(n)
        return self.mkl_set(n) if self.mkl_set is not None else None

    def restore(self, n: int, mkl: int | None) -> None:
        self.omp_set(n)
        if self.mkl_set is not None and mkl is not None:
            self.mkl_set(mkl)


def _loaded_libraries() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if ".so" in line})
    except OSError:  # not Linux: no per-thread control, torch's threading as it is
        return []


def _open(path: str):
    try:
        return ctypes.CDLL(path, mode=getattr(os, "RTLD_NOLOAD", 0))
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def runtime() -> _Runtime:
    torch.get_num_threads()  # torch loaded its threading libraries
    return _Runtime()


@functools.lru_cache(maxsize=1)
def parallel_work() -> int:
    """Multiply-adds from which a product inside :func:`serial_passes` runs on every thread;
    ``ANATOMY_PARALLEL_WORK`` overrides (0: every pass on every thread, as torch does). Read once
    per process (``parallel_work.cache_clear()`` reads it again)."""
    setting = os.environ.get(PARALLEL_ENV, "").strip()
    try:
        return max(0, int(float(setting))) if setting else DEFAULT_WORK
    except (ValueError, OverflowError):
        return DEFAULT_WORK


def work_setting_ignored() -> str | None:
    """The ignored value of ``ANATOMY_PARALLEL_WORK``, when it is not a number."""
    setting = os.environ.get(PARALLEL_ENV, "").strip()
    try:
        float(setting or 0)
    except ValueError:
        return setting
    return None


@contextlib.contextmanager
def serial_passes(threads: int | None = None):
    """This thread's CPU passes on one thread, products of :func:`threaded` on ``threads`` (default:
    this thread's torch thread count); on exit this thread's settings are as they were. A no-op with
    one thread, when nested, with ``ANATOMY_PARALLEL_WORK=0``, with the CPU routes off
    (``ANATOMY_KERNELS=plain``), or where the OpenMP runtime is not libgomp."""
    rt = runtime()
    threads = threads or torch.get_num_threads()  # also makes torch set up this thread's threading first
    if threads < 2 or _THREADS.get() or not parallel_work() or not switch.enabled() or not rt.available:
        yield
        return
    before = rt.omp_get()
    mkl = rt.set(1)
    token = _THREADS.set(threads)
    try:
        yield
    finally:
        _THREADS.reset(token)
        rt.restore(before, mkl)


def active() -> bool:
    """Whether this thread is inside :func:`serial_passes` (with more than one thread)."""
    return _THREADS.get() >= 2


def threaded(work: int, product, *args, **kwargs):
    """``product(*args, **kwargs)``, on every thread where ``work`` (its multiply-adds) is at least
    :func:`parallel_work` inside :func:`serial_passes`; else where it is called."""
    threads = _THREADS.get()
    if threads < 2 or work < parallel_work():  # 1: a part of spread, on its own thread
        return product(*args, **kwargs)
    rt = runtime()
    rt.set(threads)
    try:
        return product(*args, **kwargs)
    finally:
        rt.set(1)


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


def _one_thread() -> None:
    torch.get_num_threads()
    runtime().set(1)
    _THREADS.set(1)


@functools.lru_cache(maxsize=4)
def _helpers(n: int) -> ThreadPoolExecutor:
    """Helper threads for :func:`spread`, each multiplying on one thread (its own setting)."""
    _forget_helpers_in_children()
    return ThreadPoolExecutor(n, thread_name_prefix="anatomy-spread", initializer=_one_thread)


@functools.lru_cache(maxsize=1)
def _forget_helpers_in_children() -> None:
    os.register_at_fork(after_in_child=_helpers.cache_clear)  # a forked child has none of the parent's threads


def describe() -> str:
    """One line for ``info`` and the app: how a CPU forward uses its threads."""
    threads, work = torch.get_num_threads(), parallel_work()
    ignored = work_setting_ignored()
    note = f"; {PARALLEL_ENV}={ignored!r} ignored: say a number" if ignored else ""
    if threads == 1:
        return "1 thread" + note
    if not work:
        return f"{threads} threads for every pass ({PARALLEL_ENV}=0)"
    if not runtime().available:
        return f"{threads} threads for every pass (the OpenMP runtime is not libgomp: torch's threading)"
    return f"{threads} threads for products of at least {work:,} multiply-adds, 1 for the rest ({PARALLEL_ENV} overrides){note}"
