"""The memory plan: what each rank holds and what one request allocates, counted by running it.

Nothing here is a formula beside the model. Each rank's part of the model is built on the meta
device and split by :func:`model.parallel.parallelize` over a stand-alone fake process group (the
rank that would run it, without the others: torch's ``FakeProcessGroup``, whose collectives leave
their buffers as they are); then the request runs through :func:`tracing.runner.trace_tokens`,
the code a real request runs, hooks, derived sites and collectives included. :class:`Allocations`
counts what that forward allocates:

- It is a ``TorchDispatchMode``: every aten op's output passes through it, whatever module,
  kernel or hook made it. It notes each output's storage (``untyped_storage()``, one Python object
  per storage) and its size once, unless an input holds that storage (a view, an in-place op,
  a cast to the dtype it has: nothing new, maybe memory from before), and a
  ``weakref.finalize`` on that storage takes the size off when the last tensor holding it is
  freed. The live total at each op, and its peak, is what a caching allocator would
  be asked for, without its rounding and fragmentation.
- The same mode measures a real run on the CPU (``meta=False``): the tests compare the prediction
  on meta tensors with that measurement over real tensors, the CPU backend switched off
  (``model.kernels.plain``: the products as a GPU forms them; its own routes keep leaner buffers,
  so on the CPU the plan is an upper bound). tracemalloc does not see torch's allocations and the
  process's RSS moves with the allocator's caching; live storage bytes are what both devices hold.
- The meta device has no values. The few places that read one are answered here: a copy to the
  host (the trace's ``.cpu()``) stays meta and is counted as host memory, a number read
  (``.item()``) is 0 and a truth value (``bool()``, the forward's checks) true, and
  ``bincount`` (the MoE's rows per expert, which it reads with ``.tolist()``) is the balanced
  count, ``N k / E`` rows per expert, what a trained router's load balancing aims at.

The weights are the parameters and buffers of the split meta model (the part a rank holds; on the
CPU also the float32-wide copies model.kernels keeps of each FP8 weight, model.stream.held_bytes),
and what a streamed pass reads from disk is the stored bytes of that part. Ranks whose parts have
the same shapes (all of them, where the heads, widths and experts divide evenly) are counted once
per process.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from model.checkpoint import CheckpointError, WeightSource, build_model, expected_specs, stored_dtype, wants_mtp
from model.names import to_hf
from model.stream import available_memory, held_bytes

GB = 1e9
DEFAULT_TOKENS = 4096  # the server's default --max-prompt-tokens: what a request may bring
aten = torch.ops.aten


class Allocations(TorchDispatchMode):
    """Live storage bytes of the tensors made inside it, and their peak (see the module's docstring).

    ``meta``: answer the reads the meta device cannot (copies to the host, scalars, ``bincount``).
    ``host`` / ``host_peak``: bytes copied to the host (a trace's values), apart from ``live``."""

    def __init__(self, meta: bool = True):
        super().__init__()
        self.meta = meta
        self.live = self.peak = 0  # device bytes
        self.host = self.host_peak = 0
        self.both_peak = 0  # device and host together: what one CPU process holds
        self._seen: set[int] = set()
        self._made: dict[tuple, tuple] = {}  # op and argument shapes -> its outputs' shapes (meta)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = args[0] if args else None
        on_meta = self.meta and isinstance(first, torch.Tensor) and first.is_meta
        if on_meta and func in (aten._local_scalar_dense.default, aten.item.default):
            return 0
        if on_meta and func is aten.is_nonzero.default:
            return True  # the checks a forward makes (FP8 scales are powers of two) hold
        if on_meta and func is aten.bincount.default:
            return _balanced(first.numel(), kwargs.get("minlength", args[2] if len(args) > 2 else 0))
        if on_meta and (kept := _kept_on_meta(func, args, kwargs)) is not None:
            out = func(*kept[0], **kept[1])  # the copy to the host, as a meta tensor
            self._note(out, host=True)
            return out
        leaves = _leaves((args, kwargs.values()))
        out = self._fresh(func, args, kwargs, leaves) if on_meta else func(*args, **kwargs)
        given = {id(t.untyped_storage()) for t in leaves if isinstance(t, torch.Tensor)}
        for t in _leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given:  # a view or in place: nothing new
                self._note(t, host=False)
        return out

    def _fresh(self, func, args: tuple, kwargs: dict, leaves: list):
        """``func`` on meta tensors, what it made remembered: the meta device's kernels are Python
        references (about a millisecond an op), and a MoE block runs the same ops on the same
        shapes for each of its experts. An op seen with the same shapes and arguments makes the
        same outputs: new tensors of the same shapes, the same input back (in place), or views of
        the same input at the same strides. What the mode counts is the same either way."""
        try:
            key = (func, *(_key(leaf) for leaf in leaves))
            hash(key)
        except TypeError:
            return func(*args, **kwargs)
        made = self._made.get(key)
        if made is not None:
            recipes, kind = made
            outs = [_remake(recipe, leaves) for recipe in recipes]
            return outs[0] if kind is None else kind(outs)
        out = func(*args, **kwargs)
        kind = None if isinstance(out, torch.Tensor) else type(out)
        outs = [out] if kind is None else list(out) if kind in (tuple, list) else [None]
        recipes = [_recipe(t, leaves) for t in outs]
        if all(r is not None for r in recipes) and all(_key(leaf) == k for leaf, k in zip(leaves, key[1:], strict=True)):
            self._made[key] = (recipes, kind)  # not when an op changed an input's shape (unsqueeze_)
        return out

    def _note(self, t: torch.Tensor, host: bool) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._seen:
            return
        n = storage.nbytes()
        self._seen.add(key)
        self._add(n, host)
        weakref.finalize(storage, self._gone, key, n, host)

    def _add(self, n: int, host: bool) -> None:
        if host:
            self.host += n
            self.host_peak = max(self.host_peak, self.host)
        else:
            self.live += n
            self.peak = max(self.peak, self.live)
        self.both_peak = max(self.both_peak, self.live + self.host)

    def _gone(self, key: int, n: int, host: bool) -> None:
        self._seen.discard(key)
        self._add(-n, host)


def _kept_on_meta(func, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A copy from the meta device to another (``.cpu()``, ``.to("cpu", ...)``, in any of the
    overloads inference mode leaves undecomposed), its arguments turned to keep it on meta; None
    for any other op."""
    if func.overloadpacket not in (aten.to, aten._to_copy):
        return None

    def elsewhere(value) -> bool:
        return isinstance(value, torch.device | str) and torch.device(value).type != "meta"

    if not any(elsewhere(v) for v in (*args[1:], kwargs.get("device"))):
        return None
    meta = torch.device("meta")
    return (
        (args[0], *(meta if elsewhere(v) else v for v in args[1:])),
        {k: meta if k == "device" and elsewhere(v) else v for k, v in kwargs.items()},
    )


def _key(value):
    """What an op's result shapes can depend on: a tensor's shape, strides and dtype (on meta, no
    values), any other argument itself."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.stride(), value.storage_offset(), value.dtype, value.device.type)
    return value


def _leaves(value) -> list:
    """The tensors and other values in an op's arguments or results (tuples and lists opened)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple | type({}.values())):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _recipe(out, leaves: list) -> tuple | None:
    """How to make ``out`` again from the op's inputs: an input itself, a view of one, or a new
    tensor; None when it is none of those (not a meta tensor)."""
    if not isinstance(out, torch.Tensor) or not out.is_meta:
        return None
    for i, leaf in enumerate(leaves):
        if out is leaf:
            return ("same", i)
    storage = id(out.untyped_storage())
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and id(leaf.untyped_storage()) == storage:
            if leaf.dtype != out.dtype:
                return None
            return ("view", i, tuple(out.shape), out.stride(), out.storage_offset())
    return ("new", tuple(out.shape), out.stride(), out.dtype)


def _remake(recipe: tuple, leaves: list) -> torch.Tensor:
    if recipe[0] == "same":
        return leaves[recipe[1]]
    if recipe[0] == "view":
        _, i, size, stride, offset = recipe
        return leaves[i].as_strided(size, stride, offset)
    _, size, stride, dtype = recipe
    return torch.empty_strided(size, stride, dtype=dtype, device="meta")


def _balanced(n: int, bins: int) -> torch.Tensor:
    """``n`` items over ``bins`` as evenly as they go (the host tensor ``.tolist()`` reads)."""
    bins = max(int(bins), 1)
    out = torch.full((bins,), n // bins, dtype=torch.int64)
    out[: n % bins] += 1
    return out


def fake_group(rank: int, world: int):
    """A process group of ``world`` ranks seen from ``rank``, with no other process behind it."""
    from torch._C._distributed_c10d import FakeProcessGroup

    make = getattr(FakeProcessGroup, "_create_internal", None)
    return make(rank, world) if make is not None else FakeProcessGroup(rank, world)


class ConfigSource(WeightSource):
    """The checkpoint a config describes, as far as a plan reads it: its architecture, the MTP
    module included when the config declares one (the released checkpoints hold it), and the
    dtype each tensor is stored in. Its values cannot be read, and its list of tensors is made
    only when asked (it builds the whole model on the meta device: seconds for the 671B)."""

    def __init__(self, args):
        self.args = args
        self.mtp = bool(args.n_mtp_layers)
        self._specs = None

    def specs(self):
        if self._specs is None:
            self._specs = expected_specs(self.args, mtp=self.mtp)
        return self._specs

    def load(self, name, device="cpu"):
        raise CheckpointError(f"{name}: a config describes a checkpoint, it holds no values")

    def where(self, name: str) -> str:
        return f"config:{name}"


# -------------------------------------------------------------------------------------------------
# one rank


@dataclass
class RankPlan:
    """Bytes one rank needs: its weights, a request's caches (KV and indexer), the forward's peak
    activations beside them, the derived sites' transient memory, the trace it copies to the host,
    and what one streamed forward pass reads from disk (its part's stored bytes, every expert it
    holds)."""

    rank: int
    weights: int
    caches: int
    activations: int
    derived: int
    trace: int
    disk: int
    peak: int = 0  # device and host together at the request's peak: what one CPU process holds beside the weights

    @property
    def device(self) -> int:
        """The device memory the rank needs with the model held."""
        return self.weights + self.caches + self.activations + self.derived

    @property
    def request(self) -> int:
        """The device memory a request needs beside the weights."""
        return self.caches + self.activations + self.derived

    def summary(self) -> dict[str, Any]:
        gb = lambda n: round(n / GB, 3)  # noqa: E731
        return {
            "rank": self.rank,
            "weights_gb": gb(self.weights),
            "caches_gb": gb(self.caches),
            "activations_gb": gb(self.activations),
            "derived_gb": gb(self.derived),
            "trace_gb": gb(self.trace),
            "total_gb": gb(self.device),
            "disk_gb_per_pass": gb(self.disk),
        }


def _split_model(args, dtype: torch.dtype, mtp: bool, rank: int, world: int):
    """Rank ``rank``'s part of the model on the meta device, split as a torchrun launch splits it."""
    from model import parallel

    model = build_model(args, dtype, mtp=mtp).eval()
    plan = parallel.parallelize(model, fake_group(rank, world)) if world > 1 else None
    return model, plan


def _stored_bytes(model, source: WeightSource) -> int:
    """What reading this part of the model from ``source`` reads: each parameter's elements at
    the dtype the checkpoint stores (``model`` may hold the first blocks only)."""
    args = source.args
    if isinstance(source, ConfigSource):  # the stored dtypes as a checkpoint of that config has them
        return sum(p.numel() * stored_dtype(name, p.dtype, args.model_type).itemsize for name, p in model.named_parameters())
    specs = source.specs()  # a tensor it lacks is counted at the model's dtype; loading names it

    def itemsize(name: str, p: torch.Tensor) -> int:
        spec = specs.get(to_hf(name, args.n_layers))
        return (spec.dtype if spec is not None else p.dtype).itemsize

    return sum(p.numel() * itemsize(name, p) for name, p in model.named_parameters())


def _wants_mtp(source: WeightSource, mtp: bool | None) -> bool:
    if isinstance(source, ConfigSource):
        return source.mtp if mtp is None else mtp and source.mtp
    return wants_mtp(source, mtp)


def _shapes(args, dtype: torch.dtype, mtp: bool, rank: int, world: int) -> tuple:
    """The shapes of rank ``rank``'s part (model.parallel.make_plan, on one unsplit meta model per
    config): ranks with the same shapes hold and allocate the same bytes."""
    from model import parallel

    if world == 1:
        return ()
    key = (args, dtype, mtp)
    if key not in _UNSPLIT:
        _UNSPLIT[key] = build_model(args, dtype, mtp=mtp)
    plan = parallel.make_plan(_UNSPLIT[key], rank, world)
    return tuple(sorted((name, part.dim, part.stop - part.start) for name, part in plan.parts.items())), len(plan.experts)


def _cache_bytes(cache) -> int:
    buffers = [b for layer in [*cache.layers, cache.mtp] for b in vars(layer).values()]
    return sum(b.data.untyped_storage().nbytes() for b in buffers if b.data is not None)


def count_run(model, plan, tokens: int, generate: int, record: Iterable[str], meta: bool = True) -> dict[str, int]:
    """One request of ``tokens`` prompt positions and ``generate`` new ones, recording ``record``,
    run through ``model`` (meta, or loaded with ``meta=False``) under :class:`Allocations`.
    Returns bytes: ``peak`` (the device), ``peak_with_host`` (device and host together),
    ``caches`` (the KV and indexer caches at the end) and ``trace`` (the trace's tensors)."""
    from .runner import trace_tokens

    device = torch.device("meta") if meta else next(model.parameters()).device
    caches = []
    real_cache = model.new_cache

    def new_cache():
        cache = real_cache()
        caches.append(cache)
        return cache

    model.new_cache = new_cache  # the run's own caches, to count what they hold at the end
    try:
        with Allocations(meta) as counted:
            trace = trace_tokens(model, [0] * tokens, record=list(record), generate=generate, plan=plan, device=device)
            found = {
                "caches": _cache_bytes(caches[-1]),
                "trace": sum(t.untyped_storage().nbytes() for t in trace.tensors.values()),
            }
            del trace, caches[:]
    finally:
        del model.new_cache
    return {**found, "peak": counted.peak, "peak_with_host": counted.both_peak}


def count_request(model, plan, tokens: int, generate: int, record: Iterable[str], meta: bool = True) -> dict[str, int]:
    """:func:`count_run` of the bare forward (logits only), then of the request with its sites
    recorded. Returns bytes: ``caches`` (the request's), ``activations`` (the bare peak beside its caches),
    ``derived`` (what recording adds to the peak on the device), ``trace`` (what it copies to the
    host), ``peak`` and ``peak_with_host`` (the recorded run's)."""
    bare = count_run(model, plan, tokens, generate, ["logits.last"], meta)
    traced = count_run(model, plan, tokens, generate, record, meta)
    return {
        "caches": traced["caches"],  # the MTP module's too, where its sites run it
        "activations": max(bare["peak"] - bare["caches"], 0),
        "derived": max(traced["peak"] - bare["peak"], 0),
        "trace": traced["trace"],
        "peak": traced["peak"],
        "peak_with_host": traced["peak_with_host"],
    }


def _depths(args) -> tuple[int, ...]:
    """The depths a request is counted at: the dense blocks and one MoE block, and one MoE block
    more (the whole model where it is no deeper)."""
    first = min(args.n_dense_layers + 1, args.n_layers)
    return (first, first + 1) if first + 1 < args.n_layers else (args.n_layers,)


# what plan_rank counted in this process: a rank's part by config and rank, a request by config and part shapes
_HELD: dict[tuple, dict[str, int]] = {}
_UNSPLIT: dict[tuple, object] = {}  # a config's meta model, to read each rank's part shapes from
_COUNTED: dict[tuple, dict[str, int]] = {}


def _deep(args, found: list[tuple[int, dict[str, int]]]) -> dict[str, int]:
    """Figures counted at the depths of :func:`_depths`, extended to ``args.n_layers`` blocks by
    their step from one depth to the next for every MoE block more."""
    (d1, first), (d2, last) = found[0], found[-1]
    more = args.n_layers - d2
    return {k: max(last[k] + more * (last[k] - first[k]) // max(d2 - d1, 1), 0) for k in last}


def plan_rank(
    source: WeightSource,
    rank: int = 0,
    world: int = 1,
    tokens: int = DEFAULT_TOKENS,
    generate: int = 0,
    record: Iterable[str] = ("default",),
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cuda",
    mtp: bool | None = None,
    weights_only: bool = False,
) -> RankPlan:
    """Rank ``rank`` of ``world``: its part's bytes, and (unless ``weights_only``) one request's.

    Everything is counted on the model's first blocks: at the two depths of :func:`_depths` (the
    dense blocks and one MoE block, then one MoE block more), each figure extended by its step
    from one to the other for every further MoE block. The MoE blocks are one module, split and
    run alike, so what a rank holds grows by the same bytes per block (its weights, a request's
    caches and trace); what a request needs at once beside the caches is one block's. A model of
    at most two MoE blocks is counted whole. Building the 671B model whole on the meta device alone
    takes longer than counting it this way."""
    from model.synthetic import truncate_layers

    with_mtp = _wants_mtp(source, mtp)

    def parts():  # (depth, this rank's part built to that depth, its split) for each depth counted
        for depth in _depths(source.args):
            yield (depth, *_split_model(truncate_layers(source.args, depth), dtype, with_mtp, rank, world))

    shapes = tuple(_shapes(truncate_layers(source.args, d), dtype, with_mtp, rank, world) for d in _depths(source.args))
    where = (source.args, with_mtp, dtype, torch.device(device).type, world, shapes)
    if where not in _HELD:  # ranks of one shape hold the same bytes
        held = [(d, {"weights": held_bytes(m, device), "disk": _stored_bytes(m, source)}) for d, m, _ in parts()]
        _HELD[where] = _deep(source.args, held)
    part = _HELD[where]
    if weights_only:
        return RankPlan(rank, part["weights"], 0, 0, 0, 0, part["disk"])
    key = (source.args, with_mtp, dtype, world, tokens, generate, tuple(record), shapes)
    if key not in _COUNTED:  # ranks of one shape, and a plan asked again, count once
        _COUNTED[key] = _deep(source.args, [(d, count_request(m, p, tokens, generate, list(record))) for d, m, p in parts()])
    counted = _COUNTED[key]
    figures = [counted[k] for k in ("caches", "activations", "derived", "trace")]
    return RankPlan(rank, part["weights"], *figures, part["disk"], counted["peak_with_host"])


# -------------------------------------------------------------------------------------------------
# every rank, and the decision


@dataclass
class MemoryPlan:
    """Every rank's :class:`RankPlan` and what follows for devices of ``device_memory`` bytes:
    ``load`` "resident" when every rank's weights and request fit, else "stream"; ``fits`` whether
    a request fits at all (streamed: a rank's request beside its largest streamed unit is not
    counted here, only that the request itself fits)."""

    ranks: list[RankPlan]
    device_memory: int | None
    tokens: int
    generate: int
    record: list[str] = field(default_factory=list)

    @property
    def load(self) -> str:
        if self.device_memory is None:
            return "resident"
        return "resident" if all(r.device <= self.device_memory for r in self.ranks) else "stream"

    @property
    def fits(self) -> bool:
        if self.device_memory is None:
            return True
        return all((r.device if self.load == "resident" else r.request) <= self.device_memory for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "load": self.load,
            "fits": self.fits,
            "ranks": len(self.ranks),
            "device_memory_gb": None if self.device_memory is None else round(self.device_memory / GB, 3),
            "tokens": self.tokens,
            "generate": self.generate,
            "record": self.record,
            "disk_gb_per_pass": round(sum(r.disk for r in self.ranks) / GB, 3),
            "per_rank": [r.summary() for r in self.ranks],
        }

    def headline(self) -> str:
        """One line: what a server on these devices holds, and what a request reads."""
        worst = max(self.ranks, key=lambda r: r.device)
        where = f"{len(self.ranks)} rank{'s' * (len(self.ranks) > 1)}"
        if self.load == "resident":
            return (
                f"resident: each of {where} holds its part ({_gb(worst.weights)} of weights, {_gb(worst.device)} "
                "with a request); a request reads nothing from disk"
            )
        return (
            f"stream: a rank's part ({_gb(worst.weights)} of weights) with a request ({_gb(worst.device)}) does not fit "
            f"in {_gb(self.device_memory)}; every forward pass (the prefill and each generated token) reads "
            f"{_gb(sum(r.disk for r in self.ranks))} from disk over the {where}"
        )


def _gb(n: int) -> str:
    return f"{n / GB:,.1f} GB" if n >= GB / 10 else f"{n / 1e6:,.1f} MB"


def weights_said(streamed: dict[str, Any]) -> str:
    """Where a stream's weights came from (model.stream.StreamStats.accounting: a trace's ``stream``
    metadata, or /health's totals), in a few words."""
    return (
        f"weights {_gb(streamed['disk_bytes'])} from disk, {_gb(streamed['host_bytes'])} from host memory,"
        f" {_gb(streamed['device_hit_bytes'])} kept on the device"
    )


def memory_plan(
    source: WeightSource,
    ranks: int = 1,
    device_memory: int | None = None,
    tokens: int = DEFAULT_TOKENS,
    generate: int = 0,
    record: Iterable[str] = ("default",),
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cuda",
    mtp: bool | None = None,
) -> MemoryPlan:
    """Every rank of a ``ranks``-rank launch (ranks whose parts have the same shapes counted once)."""
    record = list(record)
    found = [plan_rank(source, rank, ranks, tokens, generate, record, dtype, device, mtp) for rank in range(ranks)]
    return MemoryPlan(found, device_memory, tokens, generate, record)


@dataclass
class Load:
    """How a process holds the model (tracing.cli.loading): ``stream`` or resident, and why."""

    stream: bool
    weights: int  # this rank's part, held
    request: int  # the device memory a request of ``tokens`` positions needs beside it
    free: int  # the device's free memory when decided
    disk: int  # what one streamed forward pass reads on this rank
    ranks: int
    tokens: int
    forced: bool = False  # --stream
    counted: RankPlan | None = None  # this rank's plan for such a request, where it was counted
    kept: tuple[int, int] | None = None  # streamed: the tiers' (device, host) budgets, tier_budgets

    @property
    def mode(self) -> str:
        return "stream" if self.stream else "resident"

    def line(self) -> str:
        per = " per rank" if self.ranks > 1 else ""
        part, free = f"{_gb(self.weights)}{per}", _gb(self.free)
        if self.forced:
            why = "as asked (--stream)"
        elif self.counted is None:
            why = f"its part, {part}, {'exceeds' if self.stream else 'of'} the {free} free"
        else:
            need = f"{_gb(self.request)} for a {self.tokens}-token request"
            why = f"its part, {part}, and {need} {'exceed' if self.stream else 'of'} the {free} free"
        if self.stream:
            passes = "every forward pass (the prefill and each generated token)"
            if self.kept is None or not any(self.kept):
                return f"model streamed ({why}): {passes} reads {_gb(self.disk)}{per} from disk"
            device, host = self.kept
            return (
                f"model streamed ({why}): {passes} reads from disk what is not kept across passes (up to {_gb(device)}"
                f" on the device, {_gb(host)} in host memory{per}), at most {_gb(self.disk)}{per}"
            )
        return f"model held in memory ({why}); a request reads nothing from disk"

    def describe(self) -> dict[str, Any]:
        return {
            "load": self.mode,
            "weights_gb": round(self.weights / GB, 3),
            "request_gb": None if self.counted is None else round(self.request / GB, 3),
            "free_gb": round(self.free / GB, 3),
            "disk_gb_per_pass": round(self.disk / GB, 3) if self.stream else 0.0,
            "device_budget_gb": round(self.kept[0] / GB, 3) if self.stream and self.kept else None,
            "host_budget_gb": round(self.kept[1] / GB, 3) if self.stream and self.kept else None,
            "tokens": self.tokens,
            "line": self.line(),
            "plan": None if self.counted is None else self.counted.summary(),  # rank 0's, where counted
        }


def decide_load(
    source: WeightSource,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    mtp: bool | None = None,
    rank: int = 0,
    world: int = 1,
    agree: bool = False,
    tokens: int = DEFAULT_TOKENS,
    stream: bool | None = None,
    free: int | None = None,
) -> Load:
    """Hold the model or stream it, decided per rank: this rank's part of the model (rank ``rank``
    of the ``world`` it is split over) plus the memory a request of ``tokens`` positions needs
    (counted by :func:`plan_rank`, default trace) against its device's free memory (``free``:
    measured when not given). ``agree``: under torchrun, where every rank calls it (a collective
    over the world): the model streams when any rank must. ``stream``: True forces it, None decides.

    A part that takes at most a quarter of the free memory is held without counting a request:
    the count runs the forward on the meta device (seconds), and a request needs less than the
    weights it runs on (36 GB beside 86 GB per rank for the 671B over 8 ranks at 4,096 tokens)."""
    tokens = max(1, min(tokens, source.args.max_seq_len))
    part = plan_rank(source, rank, world, dtype=dtype, device=device, mtp=mtp, weights_only=True)
    free = available_memory(device) if free is None else free
    counted = None
    if stream is None and free / 4 < part.weights <= free:
        counted = plan_rank(source, rank, world, tokens, 0, ("default",), dtype, device, mtp)
    request = counted.request if counted is not None else 0
    must = bool(stream) or part.weights + request > free
    if agree:
        import torch.distributed as dist

        flag = torch.tensor([int(must)], device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        must = bool(flag.item())
    return Load(must, part.weights, request, free, part.disk, world, tokens, bool(stream), counted)


HOST_RESERVE = 8 * 2**30  # host memory a default host budget leaves to everything else, at least
HOST_RESERVE_SHARE = 0.1  # and at least this share of the available memory


def tier_budgets(
    source: WeightSource,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    mtp: bool | None = None,
    rank: int = 0,
    world: int = 1,
    tokens: int = DEFAULT_TOKENS,
    load: Load | None = None,
    device_budget: int | None = None,
    host_budget: int | None = None,
) -> tuple[int, int]:
    """The (device, host) budgets of a streamed model's tiers (model.tiers), each as given or, when
    None, the default:

    - device: its free memory less what a request of ``tokens`` positions needs (counted as
      :func:`plan_rank` counts it) and room for three of the largest unit the stream loads in flight
      (what it reads ahead is not the tiers', and the stream checks that its largest unit fits in
      what is free); on the CPU shared by the ranks on this node;
    - host: the available host memory less a reserve (``HOST_RESERVE`` or ``HOST_RESERVE_SHARE`` of
      it, the larger), shared by the ranks on this node (``LOCAL_WORLD_SIZE``); on the CPU, where
      the device tier is host memory too, less the device budget.

    Neither is more than the weights (this rank's part, as held and as stored) can use: as ``load``
    (decide_load's, for the same rank and settings) counted them, or counted here."""
    import os

    device = torch.device(device)
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), 1)  # ranks sharing this node's host memory
    tokens = max(1, min(tokens, source.args.max_seq_len))
    if load is not None:  # decide_load counted this rank's part already
        weights, disk = load.weights, load.disk
    else:
        part = plan_rank(source, rank, world, dtype=dtype, device=device, mtp=mtp, weights_only=True)
        weights, disk = part.weights, part.disk
    if device_budget is None:
        counted = load.counted if load is not None and load.counted is not None else None
        if counted is None:
            counted = plan_rank(source, rank, world, tokens, 0, ("default",), dtype, device, mtp)
        free = available_memory(device)
        device_budget = max(free - counted.request - 3 * _largest_unit(source), 0)
        if device.type == "cpu":
            device_budget //= local
    if host_budget is None:
        free = available_memory("cpu")
        host_budget = max(free - max(HOST_RESERVE, int(HOST_RESERVE_SHARE * free)), 0)
        host_budget //= local
        if device.type == "cpu":
            host_budget = max(host_budget - device_budget, 0)
    return min(device_budget, weights), min(host_budget, disk)


def _largest_unit(source: WeightSource) -> int:
    """The most bytes one unit the stream loads together (model.stream: the embedding, a block
    without its routed experts, one routed expert, the norm, the head) takes as held (the head in
    float32)."""
    import re

    from model.names import FAMILIES, from_hf

    wider = FAMILIES[source.args.model_type].stored_bf16
    units: dict[str, int] = {}
    for name, spec in source.specs().items():
        ours = from_hf(name)
        unit = re.match(r"(layers\.\d+\.ffn\.experts\.\d+|layers\.\d+|mtp\.\d+|[a-z]+)", ours).group(1)
        units[unit] = units.get(unit, 0) + math.prod(spec.shape) * (4 if ours.endswith(wider) else spec.dtype.itemsize)
    return max(units.values())


def parse_memory(text: str) -> int:
    """``141GB``, ``80GiB``, ``1.5TB`` or plain bytes: a device's memory in bytes."""
    units = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    s = text.strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if unit not in units or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not an amount of memory: write it like 141GB, 80GiB or 1.5TB")
    return int(value * units[unit])
