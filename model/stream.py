"""Streaming execution: a prefill through a model whose weights do not fit, one block at a time.

The model is built on the meta device (:func:`model.checkpoint.build_model`) and run by its own
``forward``: :class:`Streamer` only adds forward hooks from outside. Before a block runs, a
pre-hook assigns its weights, read from the :class:`~model.checkpoint.WeightSource` onto the
target device by a :class:`~model.checkpoint.TensorReader`; after it ran, a hook puts the meta
parameters back, which frees the weights. The embedding, the final norm and the head are
streamed the same way. In a MoE block the routed experts are not part of the block's load: a
hook on the router reads which experts it picked, and a pre-hook on each of those experts loads
it just before the MoE loop calls it (the loop skips experts with no tokens, so unpicked experts
are never read); after it ran it is freed. The multi-token-prediction module (``model.mtp``, when
the model was built with it) is one more step after the head, streamed like a block with its
experts, and only in a forward that runs it (``mtp=True`` or its sites observed): the head stays
loaded for it and the embedding is read again, since it reads both.

Because the same module objects run the same code, logits and every hook point's value are
identical to those of the fully loaded model, and hooks registered by name (tracing) fire as
usual. Reader threads (several reads in flight) read ahead: the next block while this one runs,
and a few of the picked experts while earlier ones run, so at most about two blocks of weights
are in use at once. With :class:`model.tiers.Tiers`, which outlives one Streamer, what its
device and host budgets hold stays between passes (a request repeated, the next decode step)
and is used or copied instead of read; a decode step then reads only what no tier holds.

    model = build_model(source.args, dtype)
    logits, stats = stream_forward(model, source, tokens, device, progress=print)  # or tracing.cli.progress.stream_bar()

or, to call the model yourself (several calls, hooks of your own):

    with Streamer(model, source, device) as streamer:
        logits = model(tokens)
    streamer.stats.bytes_read

:func:`held_bytes` and :func:`available_memory` are what tracing.plan.decide_load compares to
decide "automatic": stream when a rank's part with a request would not fit.
"""

from __future__ import annotations

import inspect
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .checkpoint import CheckpointError, TensorReader, WeightSource, numel_of, validate
from .fp8 import FP8
from .hooks import Hooks
from .kernels import use_once
from .moe import MoE
from .names import FAMILIES, from_hf, to_hf
from .tiers import Tiers
from .transformer import Transformer

_FORWARD = inspect.signature(Transformer.forward)  # the model's call, to read its ``mtp`` argument

if TYPE_CHECKING:
    from .parallel import Part


# -------------------------------------------------------------------------------------------------
# what is loaded together


@dataclass
class _Param:
    owner: nn.Module
    leaf: str
    name: str  # module path, e.g. layers.3.attn.wq_a.weight
    meta: nn.Parameter  # the meta parameter put back when the weight is freed


@dataclass
class _Unit:
    """Weights loaded and freed together: the embedding, a block without its routed experts,
    one routed expert, the final norm, the head."""

    name: str
    params: list[_Param]
    block: int | None = None  # the block a unit belongs to
    nbytes: int = 0
    arena: torch.Tensor | None = None  # host memory its weights were read into, reused when freed
    stored: int = 0  # the checkpoint's bytes of its weights (this rank's part)
    expert: bool = False  # a routed expert (model.tiers keeps the others first)


@dataclass
class UnitStats:
    """One streamed module: bytes read for it from disk (``bytes``), copied from the host tier
    and found on the device (model.tiers; the checkpoint's bytes, so the three add up to the
    unit's weights), seconds loading, seconds of its forward (wall) and of that time spent waiting
    for weights. A block's figures include its experts."""

    name: str
    bytes: int = 0
    host_bytes: int = 0
    device_hit_bytes: int = 0
    load_seconds: float = 0.0
    wall_seconds: float = 0.0
    wait_seconds: float = 0.0
    experts: int = 0

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.wait_seconds, 0.0)


@dataclass
class StreamStats:
    """A stream's figures. Every byte of the weights a pass ran on came from one place: read from
    disk (``bytes_read``, also ``disk_bytes``), copied from the host tier (``host_bytes``) or held
    by the device tier (``device_hit_bytes``); all three count the checkpoint's bytes."""

    bytes_read: int = 0
    host_bytes: int = 0
    device_hit_bytes: int = 0
    load_seconds: float = 0.0  # time the reads took (in the loader thread when prefetching)
    wait_seconds: float = 0.0  # time the forward stood waiting for weights
    wall_seconds: float = 0.0
    peak_resident_bytes: int = 0  # weights loaded and not yet freed, at most at once
    units: dict[str, UnitStats] = field(default_factory=dict)  # embed, layers.N, norm, head, mtp.0
    reads: Counter[str] = field(default_factory=Counter)  # checkpoint name -> times read
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)  # model.tiers.Tiers.describe() at the end
    experts: Counter[str] = field(default_factory=Counter)  # routed experts loaded, by where from: disk, host, device

    @property
    def disk_bytes(self) -> int:
        return self.bytes_read

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.wait_seconds, 0.0)

    def accounting(self) -> dict[str, Any]:
        """Where the weights came from, for a trace's metadata, a summary line and /health (no
        times: a trace is the same bytes whenever the same request meets the same tiers)."""
        return {"disk_bytes": self.bytes_read, "host_bytes": self.host_bytes, "device_hit_bytes": self.device_hit_bytes}

    def summary(self) -> dict[str, Any]:
        """Plain numbers for JSON."""
        return {
            "bytes_read": self.bytes_read,
            "disk_bytes": self.bytes_read,
            "host_bytes": self.host_bytes,
            "device_hit_bytes": self.device_hit_bytes,
            "load_seconds": round(self.load_seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4),
            "wall_seconds": round(self.wall_seconds, 4),
            "compute_seconds": round(self.compute_seconds, 4),
            "peak_resident_bytes": self.peak_resident_bytes,
            "read_gbps": round(self.bytes_read / self.load_seconds / 1e9, 3) if self.load_seconds else None,
            "stream_gbps": round(self.bytes_read / self.wall_seconds / 1e9, 3) if self.wall_seconds else None,
            "tiers": self.tiers,
        }


@dataclass(frozen=True)
class StreamEvent:
    """Progress after each streamed step (the embedding, each block, the head, the MTP module)."""

    step: int  # 1-based
    total: int  # n_layers + 2, and one more for the MTP module when it runs
    name: str  # "embed", "layers.7", "head", "mtp.0"
    bytes_read: int  # so far, read-ahead included
    seconds: float  # since the stream started
    unit: UnitStats


ProgressFn = Callable[[StreamEvent], None]


# -------------------------------------------------------------------------------------------------
# the streamer

_SPARE_ARENAS = 4  # freed host buffers kept for the next reads (a block, its read-ahead, experts)


def _aligned(n: int) -> int:
    return -(-n // 64) * 64  # tensors in a shared buffer start on 64-byte boundaries


def _parameters(tensors: list[torch.Tensor]) -> list[nn.Parameter]:
    # model.kernels keeps no copy of a streamed weight beside it: the tiers' budgets count the weights
    return [use_once(nn.Parameter(t, requires_grad=False)) for t in tensors]


def _pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # torch's host allocator reuses freed ones


class _Ready:
    """A load done on demand by the thread that asks (no read-ahead)."""

    def __init__(self, fn: Callable[[], Any]):
        self._fn = fn

    def result(self) -> Any:
        return self._fn()

    def cancel(self) -> bool:
        return True


class Streamer:
    """Context manager that streams ``model``'s weights from ``source`` while the model runs.

    ``model`` must be on the meta device. ``prefetch`` reads ahead in a background thread (the
    next block, and ``expert_window`` of the picked experts); without it every read happens when
    the weights are needed, so ``stats`` separates read time from compute exactly.
    ``synchronize`` (CUDA) waits for the device at each step so per-step times are true.
    ``plan`` (from :func:`model.parallel.parallelize`) makes each rank read only its part.
    On exit every weight is freed and the model is back on the meta device. Each forward call
    inside the context streams every block again (a prefill, or one decode step).

    ``tiers`` (:class:`model.tiers.Tiers`, which outlives the context) keeps units between passes
    and contexts within its budgets: a unit it holds on the device is used as it is, one it holds
    on the host is copied, anything else read from disk and offered to it. Without it nothing is
    kept. ``readers`` threads load at once (read-ahead), each with its own staging buffers.
    """

    def __init__(
        self,
        model: Transformer,
        source: WeightSource,
        device: torch.device | str = "cpu",
        *,
        prefetch: bool = True,
        expert_window: int = 4,
        progress: ProgressFn | None = None,
        synchronize: bool = False,
        plan: Any = None,
        tiers: Tiers | None = None,
        readers: int = 4,
    ):
        self.model = model
        self.source = source
        self.device = torch.device(device)
        self.prefetch = prefetch
        self.expert_window = max(int(expert_window), 1)
        self.progress = progress
        self.synchronize = synchronize and self.device.type == "cuda"
        self.parts: dict[str, Part] = dict(plan.parts) if plan is not None else {}
        self.stats = StreamStats()
        self.tiers = tiers if tiers is not None else Tiers(self.device)
        if self.tiers.device.type != self.device.type:
            raise ValueError(f"tiers for {self.tiers.device} cannot serve a stream to {self.device}")
        self.readers = max(int(readers), 1)
        self._local = threading.local()  # each reader thread's CUDA stream
        self._hooks: Hooks | None = None
        self._chain: list[_Unit] = []
        self._experts: dict[tuple[int, int], _Unit] = {}
        self._block_experts: dict[int, list[_Unit]] = {}
        self._owners: dict[int, str] = {}  # block index -> the unit its experts' figures go to
        self._gates: list[tuple[int, nn.Module]] = []
        self._n_layers = model.args.n_layers
        self._head_k = self._mtp_k = None  # the head's and the MTP module's places in the chain
        self._drafting = False  # whether this forward runs the MTP module (Transformer.forward's condition)
        self._pending: dict[str, Any] = {}
        self._queued: dict[int, deque[int]] = {}
        self._resident: dict[str, int] = {}
        self._arenas: list[torch.Tensor] = []  # spare host buffers, smallest first
        self._loaded_unassigned = 0
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._reader: TensorReader | None = None
        self._t0 = 0.0
        self._enter_time: dict[str, float] = {}

    # setup -------------------------------------------------------------------------------------
    def __enter__(self) -> Streamer:
        model = self.model
        on_meta = [n for n, p in model.named_parameters() if p.device.type != "meta"]
        if on_meta:
            raise ValueError(f"streaming needs a model built on the meta device; {on_meta[0]} holds a tensor")
        self._reader = TensorReader(self.source)
        validate(self.model, self.source, parts=self.parts)
        self._chain = [self._unit("embed", model.embed)]
        for i, block in enumerate(model.layers):
            self._chain.append(self._block_unit(f"layers.{i}", i, block, block, f"layers.{i}"))
        self._chain += [self._unit("norm", model.norm), self._unit("head", model.head)]
        self._head_k = len(self._chain) - 1
        for j, module in enumerate(model.mtp):  # after the head: it reads the main embedding and head
            self._mtp_k = len(self._chain)
            self._chain.append(self._block_unit(f"mtp.{j}", self._n_layers + j, module, module.block, f"mtp.{j}.block"))
        for unit in [*self._chain, *self._experts.values()]:
            unit.stored = sum(self._reader.nbytes(self._hf(p.name), self.parts.get(p.name)) for p in unit.params)
        try:
            self._check_memory()
        except CheckpointError:
            self._reader.close()
            raise
        hooks = self._hooks = Hooks()  # the weights come in for this thread's forward
        for k, unit in enumerate(self._chain):
            module = model.get_submodule(unit.name)
            hooks.before(module, self._pre_hook(k), prepend=True)
            hooks.after(module, self._post_hook(k))
        for (i, j), unit in self._experts.items():
            expert = model.get_submodule(unit.name)
            hooks.before(expert, self._expert_pre_hook(i, j), prepend=True)
            hooks.after(expert, self._expert_post_hook(i, j))
        for i, gate in self._gates:
            hooks.after(gate, self._gate_hook(i))
        hooks.before(model, self._pass_hook, with_kwargs=True)
        if self.prefetch:
            self._pool = ThreadPoolExecutor(max_workers=self.readers, thread_name_prefix="stream-loader")
        self._t0 = time.perf_counter()
        self._pending[self._chain[0].name] = self._submit(self._chain[0])
        return self

    def __exit__(self, *exc: object) -> None:
        if self._hooks is not None:
            self._hooks.remove()
            self._hooks = None
        for fut in self._pending.values():
            fut.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        for unit in [*self._chain, *self._experts.values()]:
            self._free(unit)
        self._arenas.clear()
        if self._reader is not None:
            self.stats.reads = self._reader.reads
            self.stats.bytes_read = self._reader.bytes_read
            self._reader.close()
        self.stats.tiers = self.tiers.describe()
        self.stats.wall_seconds = time.perf_counter() - self._t0

    def replay(self, picked: dict[int, list[int]] | None = None) -> None:
        """Read and free every step as a forward would, without computing: the embedding, each
        block with the experts ``picked[block]``, the norm, the head, and the MTP module when
        ``picked`` names its block (n_layers) with the embedding again. For measuring the reads
        (a benchmark's load-only pass), with the same reader, read-ahead and bookkeeping."""
        picked = picked or {}
        self.tiers.begin_pass()
        self._drafting = self._mtp_k is not None and self._n_layers in picked
        for k, unit in enumerate(self._chain):
            if k == self._mtp_k and not self._drafting:
                continue
            module = self.model.get_submodule(unit.name)
            self._pre_hook(k)(module, ())
            if unit.block is not None and unit.block in self._block_experts:
                chosen = torch.tensor(sorted(picked.get(unit.block, ())), dtype=torch.int64)
                self._gate_hook(unit.block)(module, (), (None, chosen))
                for j in chosen.tolist():
                    if (unit.block, j) in self._experts:
                        self._expert_pre_hook(unit.block, j)(module, ())
                        self._expert_post_hook(unit.block, j)(module, (), None)
            self._post_hook(k)(module, (), None)

    def _check_memory(self) -> None:
        """Refuse, before the first read, a unit (a block, an expert, the head) that cannot fit in
        the device's free memory on its own: a config may describe any size, streaming bounds
        what is resident, not what one unit needs."""
        reader = self._reader
        largest = max(
            [*self._chain, *self._experts.values()],
            key=lambda unit: sum(reader.nbytes(self._hf(p.name), self.parts.get(p.name)) for p in unit.params),
        )
        nbytes = sum(reader.nbytes(self._hf(p.name), self.parts.get(p.name)) for p in largest.params)
        free = available_memory(self.device)
        if nbytes > free:
            raise CheckpointError(
                f"{largest.name} alone takes {nbytes / 2**30:,.1f} GiB and {self.device} has {free / 2**30:,.1f} GiB free"
            )

    def _hf(self, name: str) -> str:
        return to_hf(name, self._n_layers)

    def _block_unit(self, name: str, i: int, module: nn.Module, block: nn.Module, path: str) -> _Unit:
        """A block's unit without its routed experts (``module`` holds ``block`` at ``path``: the MTP
        module holds its norms and projection too), and one unit for each expert it holds."""
        unit = self._unit(name, module, skip=".ffn.experts.")
        unit.block = i
        self._owners[i] = name
        if isinstance(block.ffn, MoE):
            self._gates.append((i, block.ffn.gate))
            for j, expert in enumerate(block.ffn.experts):
                if expert is not None:
                    self._experts[i, j] = eu = self._unit(f"{path}.ffn.experts.{j}", expert)
                    eu.block, eu.expert = i, True
                    self._block_experts.setdefault(i, []).append(eu)
        return unit

    def _unit(self, name: str, module: nn.Module, skip: str | None = None) -> _Unit:
        params = []
        for pname, p in module.named_parameters(prefix=name):
            if skip and skip in pname:
                continue
            *path, leaf = pname[len(name) + 1 :].split(".")
            owner = module
            for part in path:
                owner = getattr(owner, part)
            params.append(_Param(owner, leaf, pname, p))
        return _Unit(name, params)

    # loading and freeing -----------------------------------------------------------------------
    def _submit(self, unit: _Unit) -> Any:
        if self._pool is None:
            return _Ready(lambda: self._load(unit))
        return self._pool.submit(self._load, unit)

    def _load(self, unit: _Unit) -> tuple[list[nn.Parameter], str]:
        """``unit``'s parameters on the device and where they came from: the device tier, the host
        tier (copied), or disk (then offered to the tiers). The device tier keeps the parameters
        themselves, so what model.kernels works out once per weight (its scales' power-of-two
        test) holds while the tier does."""
        t = time.perf_counter()
        found = self.tiers.lookup(unit.name)
        if found is not None and found[0] == "device":
            tensors, where = found[1], "device"
        elif found is not None:
            tensors, where = _parameters(self._to_device(unit, found[1], copy=True)), "host"
            self.tiers.offer(unit.name, tensors, None, unit.stored, unit.expert, self._dtypes(unit))
        else:
            used, raw = self._read(unit)
            tensors, where = _parameters(used), "disk"
            self.tiers.offer(unit.name, tensors, raw, unit.stored, unit.expert, self._dtypes(unit))
        nbytes = sum(t.numel() * t.element_size() for t in tensors)  # as held, in the parameters' dtypes
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t
        with self._lock:
            unit.nbytes = nbytes
            self.stats.load_seconds += seconds
            self._loaded_unassigned += nbytes
            self._note_peak()
            owner = self.stats.units.setdefault(self._owner_name(unit), UnitStats(self._owner_name(unit)))
            if where == "disk":
                owner.bytes += unit.stored
            elif where == "host":
                owner.host_bytes += unit.stored
                self.stats.host_bytes += unit.stored
            else:
                owner.device_hit_bytes += unit.stored
                self.stats.device_hit_bytes += unit.stored
            owner.load_seconds += seconds
            if unit.expert:
                self.stats.experts[where] += 1
            if unit.name != owner.name:
                owner.experts += 1
        return tensors, where

    def _read(self, unit: _Unit) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Read ``unit`` from disk: (its tensors on the device, in the parameters' dtypes; the
        tensors as read on the host, or None when read straight to the device). On the CPU, and
        on a GPU whose host tier may keep the unit, the bytes land in host memory first."""
        reader, cpu = self._reader, self.device.type == "cpu"
        to_host = cpu or self.tiers.keeps_raw
        host = torch.device("cpu")
        # host reads go into memory recycled from freed weights (on a GPU: page-locked memory): fresh
        # pages would be faulted in (zeroed by the kernel) on every read, which halves the read speed
        direct = [to_host and reader.direct(host, self.parts.get(p.name)) for p in unit.params]
        sizes = [
            reader.nbytes(self._hf(p.name), self.parts.get(p.name)) if d else 0 for p, d in zip(unit.params, direct, strict=True)
        ]
        offsets = [sum(_aligned(n) for n in sizes[:i]) for i in range(len(sizes))]
        arena = None
        if sum(sizes):
            arena = self._arena(sum(_aligned(n) for n in sizes)) if cpu else _pinned(sum(_aligned(n) for n in sizes))
            unit.arena = arena if cpu else None
        stream = self._reader_stream()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            raw = []
            for p, size, offset in zip(unit.params, sizes, offsets, strict=True):
                into = arena[offset : offset + size] if size else None
                tensor = reader.read(self._hf(p.name), host if to_host else self.device, self.parts.get(p.name), into)
                if to_host and not cpu and not tensor.is_pinned():
                    tensor = tensor.pin_memory()
                raw.append(tensor)
            if not to_host:  # on the device already: the head and weights_proj made float32 there
                used = [t if t.dtype == p.meta.dtype else t.to(p.meta.dtype) for p, t in zip(unit.params, raw, strict=True)]
        if not to_host:
            if stream is not None:
                stream.synchronize()
            return used, None
        return self._to_device(unit, raw), raw

    def _to_device(self, unit: _Unit, raw: list[torch.Tensor], copy: bool = False) -> list[torch.Tensor]:
        """Host tensors as read to the device, in the parameters' dtypes (the head and weights_proj:
        bf16 stored, float32 held). On a GPU from page-locked memory on the thread's own stream,
        beside the compute; ``copy`` on the CPU: a copy even where the dtype is the same."""
        stream = self._reader_stream()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            out = [t.to(self.device, p.meta.dtype, non_blocking=True, copy=copy) for p, t in zip(unit.params, raw, strict=True)]
        if stream is not None:
            stream.synchronize()
        return out

    def _dtypes(self, unit: _Unit) -> list[torch.dtype]:
        return [self._reader.specs[self._hf(p.name)].dtype for p in unit.params]

    def _reader_stream(self) -> Any:
        """On a GPU, this reader thread's own CUDA stream (its copies run beside the compute); else None."""
        if self.device.type != "cuda":
            return None
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return stream

    def _owner_name(self, unit: _Unit) -> str:
        return self._owners[unit.block] if unit.block is not None else unit.name

    def _note_peak(self) -> None:
        now = sum(self._resident.values()) + self._loaded_unassigned
        self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, now)

    def _take(self, unit: _Unit) -> None:
        """Wait for ``unit``'s tensors (reading them now if nobody did) and assign them."""
        if unit.name in self._resident:
            return
        fut = self._pending.pop(unit.name, None) or self._submit(unit)
        t = time.perf_counter()
        tensors, _ = fut.result()
        waited = time.perf_counter() - t
        self.stats.wait_seconds += waited
        owner = self.stats.units.get(self._owner_name(unit))
        if owner is not None:
            owner.wait_seconds += waited
        compute = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        for p, tensor in zip(unit.params, tensors, strict=True):
            if compute is not None:
                tensor.record_stream(compute)  # made on a reader's stream: not reused before the compute is done
            p.owner._parameters[p.leaf] = tensor
        with self._lock:
            self._loaded_unassigned -= unit.nbytes
            self._resident[unit.name] = unit.nbytes

    def _free(self, unit: _Unit) -> None:
        for p in unit.params:
            p.owner._parameters[p.leaf] = p.meta
        kept = unit.arena is not None and self.tiers.holds(unit.name)  # its memory is the tier's now
        with self._lock:
            self._resident.pop(unit.name, None)
            if unit.arena is not None and not kept:
                self._arenas.append(unit.arena)
                self._arenas.sort(key=len)
                del self._arenas[:-_SPARE_ARENAS]  # keep the largest few spare
            unit.arena = None

    def _arena(self, nbytes: int) -> torch.Tensor:
        """A host buffer of at least ``nbytes``: the smallest spare one that fits, else a new one."""
        with self._lock:
            for i, buffer in enumerate(self._arenas):
                if len(buffer) >= nbytes:
                    return self._arenas.pop(i)
        return torch.empty(nbytes, dtype=torch.uint8)

    def _ahead(self, unit: _Unit) -> None:
        if unit.name not in self._pending and unit.name not in self._resident:
            self._pending[unit.name] = self._submit(unit)

    # hooks -------------------------------------------------------------------------------------
    def _pass_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Before each forward: one pass more for the tiers' recent use, and whether it will run the
        MTP module (asked for, or its sites observed)."""
        self.tiers.begin_pass()
        if self._mtp_k is None:
            return
        asked = _FORWARD.bind(module, *args, **kwargs).arguments.get("mtp", False)  # by name, however it was passed
        self._drafting = bool(asked) or self.model.mtp[0].logits.observed

    def _pre_hook(self, k: int) -> Callable[..., None]:
        unit = self._chain[k]

        def hook(module: nn.Module, args: Any) -> None:
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            self._enter_time[unit.name] = time.perf_counter()
            if k + 1 < len(self._chain) and (k + 1 != self._mtp_k or self._drafting):
                self._ahead(self._chain[k + 1])  # read the next step while this one runs
                if k + 1 == self._mtp_k:
                    self._ahead(self._chain[0])  # the embedding again, which the MTP module reads
            self._take(unit)
            if k == self._mtp_k:  # the main embedding and head, as the MTP module calls them
                self._take(self._chain[0])
                self._take(self._chain[self._head_k])

        return hook

    def _post_hook(self, k: int) -> Callable[..., None]:
        unit = self._chain[k]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self.synchronize:
                torch.cuda.synchronize(self.device)
            if not (k == self._head_k and self._drafting):  # else kept for the MTP module
                self._free(unit)
            if k == self._mtp_k:
                self._free(self._chain[0])
                self._free(self._chain[self._head_k])
            if unit.block is not None:
                for eu in self._block_experts.get(unit.block, ()):
                    self._free(eu)
                self._queued.pop(unit.block, None)
            stats = self.stats.units.setdefault(unit.name, UnitStats(unit.name))
            stats.wall_seconds += time.perf_counter() - self._enter_time.pop(unit.name, time.perf_counter())
            if self.progress is not None and unit.name != "norm":
                step = k if k >= self._head_k else k + 1  # the norm has no step of its own
                total = max(len(self._chain) - 1 - (self._mtp_k is not None and not self._drafting), step)
                with self._lock:
                    done = self._reader.bytes_read
                self.progress(StreamEvent(step, total, unit.name, done, time.perf_counter() - self._t0, stats))

        return hook

    def _gate_hook(self, i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: tuple[torch.Tensor, torch.Tensor]) -> None:
            picked = sorted(set(output[1].flatten().tolist()))  # the MoE loop's order
            order = deque(j for j in picked if (i, j) in self._experts)
            for _ in range(min(self.expert_window, len(order))):
                self._ahead(self._experts[i, order.popleft()])
            self._queued[i] = order

        return hook

    def _expert_pre_hook(self, i: int, j: int) -> Callable[..., None]:
        unit = self._experts[i, j]

        def hook(module: nn.Module, args: Any) -> None:
            order = self._queued.get(i)
            if order:
                self._ahead(self._experts[i, order.popleft()])
            self._take(unit)

        return hook

    def _expert_post_hook(self, i: int, j: int) -> Callable[..., None]:
        unit = self._experts[i, j]

        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._free(unit)

        return hook


def stream_forward(
    model: Transformer,
    source: WeightSource,
    tokens: torch.Tensor,
    device: torch.device | str | None = None,
    *,
    all_logits: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, StreamStats]:
    """One prefill of ``tokens`` (B, T) streamed block by block; returns (logits, stats).

    Same result as ``load_model(source, device)(tokens, all_logits=...)``, hooks included.
    ``options`` go to :class:`Streamer` (prefetch, expert_window, progress, synchronize, plan).
    """
    device = torch.device(device) if device is not None else tokens.device
    with Streamer(model, source, device, **options) as streamer, torch.inference_mode():
        logits = model(tokens.to(device), all_logits=all_logits)
    return logits, streamer.stats


# -------------------------------------------------------------------------------------------------
# the "automatic" decision


def model_bytes(source: WeightSource, device: torch.device | str = "cpu") -> int:
    """Memory the fully loaded model takes on ``device``: its weights (those its family stores in
    bfloat16 and holds in float32 at 4 bytes), plus on the CPU the copies model.kernels keeps of
    each FP8 weight once used (4 bytes per weight: its codes decoded to float32)."""
    specs = source.specs()
    total = 0
    cpu = torch.device(device).type == "cpu"
    wider = FAMILIES[source.args.model_type].stored_bf16  # stored in bfloat16, held in float32
    for name, spec in specs.items():
        numel = numel_of(spec.shape)
        total += numel * (4 if from_hf(name).endswith(wider) else spec.dtype.itemsize)
        if cpu and spec.dtype == FP8:
            total += numel * 4
    return total


def held_bytes(model: nn.Module, device: torch.device | str = "cpu") -> int:
    """Memory ``model`` (built on the meta device, whole or split for one rank by
    model.parallel.parallelize) takes once loaded on ``device``: its parameters and buffers as the
    model holds them, plus on the CPU the copies model.kernels keeps of each FP8 weight (4 bytes
    per weight, as :func:`model_bytes`)."""
    cpu = torch.device(device).type == "cpu"
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    if cpu:
        total += sum(4 * p.numel() for p in model.parameters() if p.dtype == FP8)
    return total


def available_memory(device: torch.device | str = "cpu") -> int:
    """Free memory of ``device`` in bytes (CUDA: free device memory; CPU: MemAvailable)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


__all__ = [
    "StreamEvent",
    "StreamStats",
    "Streamer",
    "UnitStats",
    "available_memory",
    "held_bytes",
    "model_bytes",
    "stream_forward",
]
