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
usual. A background thread reads ahead: the next block while this one runs, and a few of the
picked experts while earlier ones run, so at most about two blocks of weights are resident.

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


@dataclass
class UnitStats:
    """One streamed module: bytes read for it, seconds reading, seconds of its forward (wall) and
    of that time spent waiting for weights. A block's figures include its experts."""

    name: str
    bytes: int = 0
    load_seconds: float = 0.0
    wall_seconds: float = 0.0
    wait_seconds: float = 0.0
    experts: int = 0

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.wait_seconds, 0.0)


@dataclass
class StreamStats:
    bytes_read: int = 0
    load_seconds: float = 0.0  # time the reads took (in the loader thread when prefetching)
    wait_seconds: float = 0.0  # time the forward stood waiting for weights
    wall_seconds: float = 0.0
    peak_resident_bytes: int = 0  # weights loaded and not yet freed, at most at once
    units: dict[str, UnitStats] = field(default_factory=dict)  # embed, layers.N, norm, head, mtp.0
    reads: Counter[str] = field(default_factory=Counter)  # checkpoint name -> times read

    @property
    def compute_seconds(self) -> float:
        return max(self.wall_seconds - self.wait_seconds, 0.0)

    def summary(self) -> dict[str, Any]:
        """Plain numbers for JSON."""
        return {
            "bytes_read": self.bytes_read,
            "load_seconds": round(self.load_seconds, 4),
            "wait_seconds": round(self.wait_seconds, 4),
            "wall_seconds": round(self.wall_seconds, 4),
            "compute_seconds": round(self.compute_seconds, 4),
            "peak_resident_bytes": self.peak_resident_bytes,
            "read_gbps": round(self.bytes_read / self.load_seconds / 1e9, 3) if self.load_seconds else None,
            "stream_gbps": round(self.bytes_read / self.wall_seconds / 1e9, 3) if self.wall_seconds else None,
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
        if self._mtp_k is not None:
            hooks.before(model, self._pass_hook, with_kwargs=True)
        if self.prefetch:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stream-loader")
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
        self.stats.wall_seconds = time.perf_counter() - self._t0

    def replay(self, picked: dict[int, list[int]] | None = None) -> None:
        """Read and free every step as a forward would, without computing: the embedding, each
        block with the experts ``picked[block]``, the norm, the head, and the MTP module when
        ``picked`` names its block (n_layers) with the embedding again. For measuring the reads
        (a benchmark's load-only pass), with the same reader, read-ahead and bookkeeping."""
        picked = picked or {}
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
                    eu.block = i
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

    def _load(self, unit: _Unit) -> list[torch.Tensor]:
        t = time.perf_counter()
        tensors, nbytes, read = [], 0, 0  # bytes held (in the parameters' dtypes), bytes read
        reader = self._reader
        # host reads go into memory recycled from freed weights: fresh pages would be faulted in
        # (zeroed by the kernel) on every read, which halves the read speed on the CPU
        sizes = [
            reader.nbytes(self._hf(p.name), self.parts.get(p.name)) if reader.direct(self.device, self.parts.get(p.name)) else 0
            for p in unit.params
        ]
        offsets = [sum(_aligned(n) for n in sizes[:i]) for i in range(len(sizes))]
        if sum(sizes):
            unit.arena = self._arena(sum(_aligned(n) for n in sizes))
        for p, size, offset in zip(unit.params, sizes, offsets, strict=True):
            into = unit.arena[offset : offset + size] if size else None
            tensor = reader.read(self._hf(p.name), self.device, self.parts.get(p.name), into)
            read += tensor.numel() * tensor.element_size()
            if tensor.dtype != p.meta.dtype:  # the head and weights_proj: bf16 stored, float32 held
                tensor = tensor.to(p.meta.dtype)
            tensors.append(tensor)
            nbytes += tensor.numel() * tensor.element_size()
        if self.synchronize:
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t
        with self._lock:
            unit.nbytes = nbytes
            self.stats.load_seconds += seconds
            self._loaded_unassigned += nbytes
            self._note_peak()
            owner = self.stats.units.setdefault(self._owner_name(unit), UnitStats(self._owner_name(unit)))
            owner.bytes += read
            owner.load_seconds += seconds
            if unit.name != owner.name:
                owner.experts += 1
        return tensors

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
        tensors = fut.result()
        waited = time.perf_counter() - t
        self.stats.wait_seconds += waited
        owner = self.stats.units.get(self._owner_name(unit))
        if owner is not None:
            owner.wait_seconds += waited
        for p, tensor in zip(unit.params, tensors, strict=True):
            # each weight is read by one forward: the CPU backend keeps no copy of it beside the freed weight
            p.owner._parameters[p.leaf] = use_once(nn.Parameter(tensor, requires_grad=False))
        with self._lock:
            self._loaded_unassigned -= unit.nbytes
            self._resident[unit.name] = unit.nbytes

    def _free(self, unit: _Unit) -> None:
        for p in unit.params:
            p.owner._parameters[p.leaf] = p.meta
        with self._lock:
            self._resident.pop(unit.name, None)
            if unit.arena is not None:
                self._arenas.append(unit.arena)
                unit.arena = None
                self._arenas.sort(key=len)
                del self._arenas[:-_SPARE_ARENAS]  # keep the largest few spare

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
        """Before each forward: whether it will run the MTP module (asked for, or its sites observed)."""
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
