"""Ready-made interventions and how they apply: ablate experts, route without the correction bias,
change the indexer's top-k (dense attention is top-k >= T), and your own hook functions. Each is a
set of hook-point replacements, applied by the Tracer in the tracing thread only, so a shared model
is never modified; reading them from a request's plain values is tracing.analyses.intervention_specs.

Patches (a site name -> a value) are the general form; these build their replacement from the
value the model computed in the same forward pass. The removals (experts, heads) may act at chosen
positions only (``positions``: a half-open range, as ``3:17@5`` or ``3:17@5:9`` on the command
line): a causal check of one position's attribution removes the part there and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from model import fp8
from model.config import ModelArgs
from model.kernels import topk
from model.moe import RouterRule, select_experts

from ..errors import InputError
from ..sites import INDEXER_MISSING, site_name, spec

Positions = tuple[int, int | None]  # [start, stop): stop None = to the end of the run


@dataclass
class PassContext:
    """What a replacement knows of the forward pass it runs in: the hook point's ``name``, the
    positions its rows hold (``positions``: a prefill's every position, a decode step's one) and the
    values of this pass that later hook points read (``seen``, by site name)."""

    name: str
    start: int  # the position of the pass's first row
    seen: dict[str, torch.Tensor]
    n_rows: int = 0  # rows (positions) of the value at this hook point

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.n_rows)

    def rows(self, within: Positions | None) -> list[int] | None:
        """The value's rows whose positions lie ``within`` (all rows for None; None when no row does)."""
        if within is None:
            return list(range(self.n_rows))
        first, stop = within
        stop = self.start + self.n_rows if stop is None else stop
        rows = [p - self.start for p in self.positions if first <= p < stop]
        return rows or None


# a replacement: (the point's output, the pass) -> new output or None (unchanged)
Replace = Callable[[torch.Tensor, PassContext], torch.Tensor | None]


def describe_positions(positions: Positions | None) -> str:
    if positions is None:
        return ""
    first, stop = positions
    return f" at position {first}" if stop == first + 1 else f" at positions {first}:{'' if stop is None else stop}"


def _outside(rows: list[int], n: int, device) -> torch.Tensor:
    """(n,) bool: True at the rows not listed."""
    out = torch.ones(n, dtype=torch.bool, device=device)
    out[rows] = False
    return out


@dataclass(frozen=True)
class Intervention:
    """Base: ``replacements(args)`` maps hook-point names to functions computing the new value."""

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        raise NotImplementedError

    def config(self, args: ModelArgs) -> ModelArgs:
        """The config the run is equivalent to (what the trace records)."""
        return args

    def during(self) -> AbstractContextManager:
        """A context the run's passes go in, for a change no hook point can make (how the model
        computes, not a value it computed): entered by the thread that runs them, left after them."""
        return nullcontext()

    def describe(self) -> str:
        return type(self).__name__

    def recorded(self) -> dict[str, torch.Tensor]:
        """Values the intervention adds to the trace once the run is over (a graph's saves)."""
        return {}


def _moe_layers(args: ModelArgs, layers: tuple[int, ...] | None) -> list[int]:
    chosen = range(args.n_dense_layers, args.n_layers) if layers is None else layers
    for layer in chosen:
        if not args.n_dense_layers <= layer < args.n_layers:
            raise InputError(f"block {layer} is not a MoE block (MoE blocks: {args.n_dense_layers}..{args.n_layers - 1})")
    return list(chosen)


def _checked_experts(args: ModelArgs, experts: dict[int, tuple[int, ...]]) -> list[tuple[int, tuple[int, ...]]]:
    """(block, expert ids) of MoE blocks, each id a routed expert of this model."""
    out = []
    for layer in _moe_layers(args, tuple(experts)):
        ids = experts[layer]
        if any(not 0 <= e < args.n_routed_experts for e in ids):
            raise InputError(f"block {layer}: experts are numbered 0..{args.n_routed_experts - 1}")
        out.append((layer, ids))
    return out


def _listing(chosen: dict[int, tuple[int, ...]]) -> str:
    return ", ".join(f"{layer}:{i}" for layer, ids in sorted(chosen.items()) for i in ids)


@dataclass(frozen=True)
class AblateExperts(Intervention):
    """Experts that are never chosen: masked out of the biased scores before groups and top-k,
    so routing goes around them as if they did not exist."""

    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> expert ids
    positions: Positions | None = None  # None: at every position

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in _checked_experts(args, self.experts):
            if args.n_routed_experts - len(ids) < args.n_activated_experts:
                raise InputError(f"block {layer}: ablating {len(ids)} experts leaves fewer than k={args.n_activated_experts}")

            def mask(value, ctx, ids=ids):  # value: (N, E)
                if (rows := ctx.rows(self.positions)) is None:
                    return None
                out = value.clone()
                out[torch.tensor(rows, device=value.device)[:, None], list(ids)] = float("-inf")
                return out

            out[site_name(layer, "ffn.gate.biased_scores")] = mask
        return out

    def describe(self) -> str:
        return "ablate " + _listing(self.experts) + describe_positions(self.positions)


@dataclass(frozen=True)
class ZeroExperts(Intervention):
    """Experts that are still chosen but contribute nothing: their weighted outputs are zeroed
    before the routed sum, so routing (and every other expert's weight) stays as it was."""

    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> expert ids
    positions: Positions | None = None  # None: at every position

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in _checked_experts(args, self.experts):
            chosen = site_name(layer, "ffn.gate.topk_indices")

            def zero(value, ctx, chosen=chosen, ids=ids):
                if (rows := ctx.rows(self.positions)) is None:
                    return None
                slots = ctx.seen[chosen].sort(dim=-1).values  # (N, k): expert_out's slots, ascending
                silent = torch.isin(slots, torch.tensor(ids, device=slots.device))
                silent[_outside(rows, len(silent), silent.device)] = False
                return value.masked_fill(silent.unsqueeze(-1), 0.0)  # (N, k, D)

            out[site_name(layer, "ffn.expert_out")] = zero
        return out

    def describe(self) -> str:
        return "zero " + _listing(self.experts) + describe_positions(self.positions)


@dataclass(frozen=True)
class AblateHeads(Intervention):
    """Attention heads whose output is zero before ``wo``: their probabilities are zeroed, so the
    head reads no value (in the prefill and in the decode path alike); ``wo`` then rounds its input,
    the zeros included, as it would any other."""

    heads: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> head ids
    positions: Positions | None = None  # None: at every position (query)

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in self.heads.items():
            if not 0 <= layer < args.n_layers:
                raise InputError(f"--ablate-heads: blocks are numbered 0..{args.n_layers - 1}")
            if any(not 0 <= h < args.n_heads for h in ids):
                raise InputError(f"block {layer}: heads are numbered 0..{args.n_heads - 1}")

            def zero(value, ctx, ids=ids):
                if value.shape[2] != args.n_heads:
                    raise InputError("--ablate-heads: a rank holds only its heads under tensor parallelism")
                if (rows := ctx.rows(self.positions)) is None:
                    return None
                out = value.clone()
                out[:, torch.tensor(rows, device=value.device)[:, None], list(ids)] = 0.0  # (B, T, H, S)
                return out

            out[site_name(layer, "attn.probs")] = zero
        return out

    def describe(self) -> str:
        return "ablate heads " + _listing(self.heads) + describe_positions(self.positions)


@dataclass(frozen=True)
class NoGateBias(Intervention):
    """Route without the correction bias: choose by the unbiased scores, groups ranked by their
    best expert, as the reference's router does when it has no bias."""

    layers: tuple[int, ...] | None = None

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        rule = RouterRule.of(args)
        for layer in _moe_layers(args, self.layers):
            scores, biased = site_name(layer, "ffn.gate.scores"), site_name(layer, "ffn.gate.biased_scores")
            out[biased] = lambda value, ctx, scores=scores: ctx.seen[scores]
            out[site_name(layer, "ffn.gate.group_scores")] = lambda value, ctx, biased=biased: (
                select_experts(ctx.seen[biased], None, rule).group_scores
            )
        return out

    def describe(self) -> str:
        if self.layers is None:
            return "no correction bias"
        return "no correction bias in blocks " + ",".join(map(str, sorted(self.layers)))


@dataclass(frozen=True)
class IndexTopK(Intervention):
    """A different index_topk for the sparse attention; ``dense()`` keeps every visible key."""

    k: int

    @classmethod
    def dense(cls) -> IndexTopK:
        return cls(1 << 30)

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        if not args.has_indexer:
            raise InputError(f"{self.describe()}: {INDEXER_MISSING}: every query already attends to all its earlier keys")
        if self.k <= 0:
            raise InputError("--index-topk must be positive")
        out: dict[str, Replace] = {}
        for layer in range(args.n_layers):
            name = site_name(layer, "attn.indexer.scores")

            def select(value, ctx, name=name):
                scores = ctx.seen[name]  # (B, T, S), -inf where masked
                values, indices = topk(scores, min(self.k, scores.shape[-1]))
                return indices.masked_fill(values == float("-inf"), -1)

            out[site_name(layer, "attn.indexer.topk_indices")] = select
        return out

    def config(self, args: ModelArgs) -> ModelArgs:
        return args.replace(index_topk=min(self.k, args.max_seq_len))

    def describe(self) -> str:
        return "dense attention" if self.k >= 1 << 30 else f"index_topk={self.k}"


@dataclass(frozen=True)
class NoActFP8(Intervention):
    """FP8 products without the activations' rounding: each FP8 linear layer multiplies its input
    as it is by the weight dequantised to the activation dtype, the indexer scores unrounded q and
    k, the MLA latent skips its FP8 simulation (model.fp8.unrounded_activations), in this run's
    passes only: a shared model rounds as before in every other thread."""

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        if not args.has_indexer:  # DeepSeek-V3's reference multiplies unrounded activations already
            raise InputError("--no-act-fp8: this model (DeepSeek-V3 layout) does not round its activations to FP8")
        return {}

    def during(self) -> AbstractContextManager:
        return fp8.unrounded_activations()

    def describe(self) -> str:
        return "no FP8 activation rounding"


def during(interventions: Sequence[Intervention]) -> ExitStack:
    """Every intervention's :meth:`Intervention.during` context, entered in order (left in reverse
    when the stack closes, also after an exception)."""
    stack = ExitStack()
    try:
        for intervention in interventions:
            stack.enter_context(intervention.during())
    except BaseException:
        stack.close()
        raise
    return stack


@dataclass(frozen=True)
class HookFunctions(Intervention):
    """Your own functions at hook points: ``{site: fn}`` where ``fn(value, ctx)`` reads the model's
    value there (batch dimension included, as the model holds it, e.g. (1, T, D)) and returns None
    to leave it, or a tensor of the same shape and dtype that the model uses instead (and the trace
    records). ``ctx`` is the :class:`PassContext`: ``ctx.positions`` are the positions of the
    value's rows in this forward pass (a generation's decode steps see one each)."""

    functions: Mapping[str, Callable[[torch.Tensor, PassContext], torch.Tensor | None]] = field(default_factory=dict)

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for name, fn in self.functions.items():
            _hook_point("hook", name)
            if not callable(fn):
                raise InputError(f"hook {name!r}: expected a function fn(value, ctx), not {type(fn).__name__}")

            def call(value, ctx, fn=fn, name=name):
                new = fn(value, ctx)
                if new is not None and (
                    not isinstance(new, torch.Tensor) or new.shape != value.shape or new.dtype != value.dtype
                ):
                    got = f"{list(new.shape)} {new.dtype}" if isinstance(new, torch.Tensor) else type(new).__name__
                    there = f"{list(value.shape)} {value.dtype}"
                    raise InputError(f"hook {name!r} returned {got}; the model's value there is {there}")
                return new

            out[name] = call
        return out

    def describe(self) -> str:
        return "hooks on " + ", ".join(sorted(self.functions))


@dataclass(frozen=True)
class PatchAt(Intervention):
    """Fixed values (a trace's, batch dimension dropped, rows by position from 0) put in at chosen
    positions only; the other positions keep the model's own: patching one position of one site
    from another run."""

    values: Mapping[str, torch.Tensor] = field(default_factory=dict, hash=False)
    positions: Positions | None = None

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for name, value in self.values.items():
            row = _hook_point("patch", name)
            check_patch(name, value)
            axes = [a for a in row.legend.split() if a != "B"]
            if axes[0] not in ("T", "N"):
                raise InputError(f"patch {name!r} has no position axis: patch it whole (--patch)")

            batched = row.legend.startswith("B")

            def put(current, ctx, value=value, name=name, batched=batched):
                if (rows := ctx.rows(self.positions)) is None:
                    return None
                wanted = [ctx.start + r for r in rows]
                if wanted[-1] >= value.shape[0]:
                    raise InputError(f"patch {name!r} holds {value.shape[0]} positions; this run reaches {wanted[-1] + 1}")
                mine = current[0] if batched else current  # (T, ...) rows by position
                if tuple(value.shape[1:]) != tuple(mine.shape[1:]):
                    want = list(mine.shape[1:])
                    raise InputError(f"patch {name!r} has rows of shape {list(value.shape[1:])}, this run needs {want}")
                new = mine.clone()
                new[rows] = value[wanted].to(device=new.device, dtype=new.dtype)
                return new.unsqueeze(0) if batched else new

            out[name] = put
        return out

    def describe(self) -> str:
        return "patched " + ", ".join(sorted(self.values)) + describe_positions(self.positions)


def _hook_point(what: str, name: str):
    """The registry row of a site a replacement may act at (the Tracer checks the model has it)."""
    row = spec(name)
    if row is None or not row.patchable or row.computed:
        raise InputError(f"{what} {name!r} is not a hook point (a computed site cannot be replaced; python -m tracing sites)")
    return row


# what a patch may hold: the model's floating-point widths, and integers for the index sites
PATCH_DTYPES = (
    *(torch.float32, torch.bfloat16, torch.float16, torch.float64),
    *(torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8),
)


def check_patch(name: str, value: torch.Tensor) -> None:
    """InputError for a patch value no run can put in: a dtype outside PATCH_DTYPES (float8, complex,
    bool), NaN or infinity."""
    if value.dtype not in PATCH_DTYPES:
        kinds = ", ".join(str(d).removeprefix("torch.") for d in PATCH_DTYPES)
        raise InputError(f"patch {name!r} is {str(value.dtype).removeprefix('torch.')}: a patch holds {kinds}")
    if value.is_floating_point() and not torch.isfinite(value).all():
        raise InputError(f"patch {name!r} holds NaN or infinite values")


def replacements_of(interventions: Sequence[Intervention], args: ModelArgs, points: Mapping) -> dict[str, list[Replace]]:
    """Every intervention's replacements by hook point, in the order they apply; InputError for a
    point this model lacks (``points``: its hook points by name)."""
    out: dict[str, list[Replace]] = {}
    for intervention in interventions:
        for name, fn in intervention.replacements(args).items():
            if name not in points:
                raise InputError(f"{intervention.describe()}: {name!r} is not a hook point of this model")
            out.setdefault(name, []).append(fn)
    return out


def replaced(name: str, value: torch.Tensor, fns: Sequence[Replace], start: int, seen: dict) -> torch.Tensor:
    """``value`` at hook point ``name`` after each replacement in turn (a pass whose first row is
    position ``start``; ``seen``: the pass's values read later)."""
    if not fns:
        return value
    axis = 0 if spec(name).legend.startswith("N") else 1  # positions: (N, ...) or (B, T, ...)
    ctx = PassContext(name, start, seen, value.shape[axis])
    for fn in fns:
        new = fn(value, ctx)
        value = value if new is None else new
    return value


@contextmanager
def applied(model, interventions: Sequence[Intervention]):
    """``model``'s forward passes in this thread under ``interventions``, recording nothing: for work
    that batches many sequences (``eval``, where the Tracer's one-sequence records do not apply). Each
    pass is a prefill of every position."""
    from model.hooks import Hooks

    from ..sites import hook_points, layer_site

    points = hook_points(model)
    replacers = replacements_of(interventions, model.args, points)
    kept = {site_name(layer_site(name)[0], read) for name in replacers for read in spec(name).reads}
    seen: dict[str, torch.Tensor] = {}

    def hook(name: str, fns: list):
        def run(module, inputs, output):
            value = replaced(name, output, fns, 0, seen)
            if name in kept:
                seen[name] = value
            return None if value is output else value

        return run

    with Hooks() as hooks, during(interventions):
        for name in sorted(set(replacers) | kept):
            hooks.after(points[name], hook(name, replacers.get(name, [])))
        yield
