"""Tensor and expert parallelism over ``torch.distributed``, applied to a built model.

The model knows nothing of parallelism (as gpt-fast's ``model.py`` and ``tp.py``): after
:func:`~model.checkpoint.build_model`, :func:`parallelize` shrinks each rank's parameters to its
part and swaps a few modules for subclasses that add the collectives; the module tree, and so
every parameter and hook-point name, stays the same. :func:`load_parallel` then reads only this
rank's part of each tensor (row ranges straight from the shards, column ranges through
``load_slice``). Without it the model runs as one process with no collectives, and nothing here
is a module-level global: the process group is an attribute of the modules that use it.

What is split, as the reference's ``inference/model.py`` (world size W, rank r):

- MLA: ``wq_b`` and ``wkv_b`` column-split (each rank computes H/W heads), ``wo`` row-split and
  all-reduced in float32 (``RowParallelLinear``). ``wq_a``, ``wkv_a`` and the norms are replicated.
- The indexer is replicated, as in the reference (its ``wq_b`` is a plain ``Linear``): every rank
  computes all index heads from the same replicated inputs, so the selected keys are bitwise the
  same on every rank and as in one process. Splitting its heads would need an all-reduce of the
  (T, S) scores whose summation order can flip near-tied selections; its weights are small.
- Dense MLP: ``w1``, ``w3`` column-split, ``w2`` row-split with the all-reduce.
- MoE: routed experts split by index (rank r holds a contiguous range, the others are None);
  the gate is replicated; the shared expert is split like the dense MLP.
- The MTP module's block (``mtp.0.block``, the checkpoint's layer n_layers) is split as a main
  block; its ``enorm``, ``hnorm``, ``eh_proj`` and ``norm`` are replicated, and it reads the main
  embedding and head through their parallel forwards.
- Embedding vocab-parallel (out-of-range ids give zero rows, then an all-reduce; exact), head
  column-split over the vocabulary with an all-gather of the logits; both replicated when the
  vocabulary does not divide by W.

Reductions differ from the reference in one respect, on purpose, so that an N-rank trace is the
one-process trace: each rank's partial product is kept in float32 (the input is cast to float32,
which is exact) rather than rounded to bfloat16 before the float32 all-reduce, and the routed
and shared parts of the MoE are reduced separately (each token's expert outputs gathered before
they are added, :class:`ExpertParallelMoE`; the shared expert inside its row-parallel ``w2``) and
added as one process adds them. The reference instead
rounds partials to bfloat16 and reduces routed + shared partials at once: an N-GPU reference run
differs from its 1-GPU run by bfloat16 noise; here only by float32 summation order, which moves a
bfloat16 value by one unit in rare elements.

FP8 weights are split on 128-row/column block boundaries only (a part must own whole scale
blocks): a layer whose split would cut a block stays replicated, with a note in the plan, or
raises :class:`ParallelError` with ``strict=True``.

Hook points: every default trace site (``resid_*``, indexer, gate, ``logits.last``) and
``attn_out``, ``ffn_out``, ``routed_out``, ``shared_out`` see the same value on every rank, the
one a single process sees. ``attn.scores`` and ``attn.probs`` hold this rank's heads only (the
tracing registry marks them rank-local); :func:`gather_heads` gathers them (a collective: call it on
every rank).

Under ``torchrun``: :func:`init_distributed` (NCCL on CUDA, gloo on CPU), then
:func:`load_parallel`; every rank runs the same forward with the same hooks (patches too), rank 0
writes the trace.

A backward pass (tracing's ``gradient_of``, where autograd records) runs on every rank, each rank
differentiating the same replicated logit difference: the collectives are Megatron's pair, a sum
over ranks forward whose gradient passes as it is (the row-parallel all-reduces, the routed slots'
gather) and, where a replicated value enters a rank's part (the column-split products, the routed
experts, the vocabulary-split head), the identity forward whose gradient is summed over the ranks.
The forward's values are the same either way.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import fp8
from .checkpoint import TensorReader, WeightSource, build_model, check_mtp_copies, validate, wants_mtp
from .linear import Linear
from .moe import MLP, MoE
from .names import to_hf
from .transformer import Embedding, Transformer


class ParallelError(ValueError):
    """A model that cannot be split over this many ranks as asked."""


@dataclass(frozen=True)
class Part:
    """The slice ``start:stop`` of dimension ``dim`` (0 rows, 1 columns) of a checkpoint tensor."""

    dim: int
    start: int
    stop: int


@dataclass
class ParallelPlan:
    """What rank ``rank`` of ``world`` holds: parameter path -> its part (parameters not listed
    are whole), the range of routed experts it holds, and what stayed replicated and why."""

    rank: int
    world: int
    parts: dict[str, Part] = field(default_factory=dict)
    experts: range = range(0)
    split_attention: list[int] = field(default_factory=list)  # blocks whose heads are split
    notes: list[str] = field(default_factory=list)
    group: Any = None  # the process group the model is split over (None: every rank of the world)


# -------------------------------------------------------------------------------------------------
# modules with collectives (swapped in for the plain ones; same names, same parameters)


def _records(x: object) -> bool:
    """Whether autograd records a function of ``x`` here (a backward pass will follow)."""
    return isinstance(x, torch.Tensor) and x.requires_grad and torch.is_grad_enabled()


class _SumOverRanks(torch.autograd.Function):
    """The sum of every rank's x; its gradient, the same on every rank, passes as it is."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _IntoRanks(torch.autograd.Function):
    """A replicated x entering this rank's part: the same value; its gradient, each rank's part of
    it, summed over the ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherLast(torch.autograd.Function):
    """Every rank's y along the last dimension; the gradient of this rank's columns comes back."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.rank, ctx.width = rank_world(group)[0], y.shape[-1]
        parts = [torch.empty_like(y) for _ in range(rank_world(group)[1])]
        dist.all_gather(parts, y.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(-1, ctx.rank * ctx.width, ctx.width).contiguous(), None


def sum_over_ranks(y: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce (sum) of ``y``: in place, or recorded for a backward pass."""
    if _records(y):
        return _SumOverRanks.apply(y, group)
    dist.all_reduce(y, group=group)
    return y


def into_ranks(x: torch.Tensor | fp8.Rounded, group: Any) -> torch.Tensor | fp8.Rounded:
    """A replicated input of this rank's part, whose gradient a backward pass sums over the ranks
    (as it is where autograd does not record; a Rounded's unrounded source carries the gradient)."""
    if isinstance(x, fp8.Rounded):
        return dataclasses.replace(x, source=into_ranks(x.source, group)) if _records(x.source) else x
    return _IntoRanks.apply(x, group) if _records(x) else x


class RowParallelLinear(Linear):
    """Input features split over ranks: float32 partial products, summed by all-reduce."""

    group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x.float())  # exact cast: the partial product stays unrounded
        return sum_over_ranks(y, self.group).to(x.dtype)


class ColumnParallelLinear(Linear):
    """Output features split over ranks (``wq_b``, ``wkv_b``, ``w1``, ``w3``): the plain product of
    this rank's rows; a backward pass sums the input's gradient over the ranks."""

    group: Any = None

    def forward(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        return super().forward(into_ranks(x, self.group))


class ColumnParallelHead(Linear):
    """Output features (the vocabulary) split over ranks; the logits are all-gathered."""

    group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(into_ranks(x, self.group)).contiguous()
        if _records(y):
            return _GatherLast.apply(y, self.group)
        parts = [torch.empty_like(y) for _ in range(rank_world(self.group)[1])]
        dist.all_gather(parts, y, group=self.group)
        return torch.cat(parts, dim=-1)


class VocabParallelEmbedding(Embedding):
    """Rows vocab_start:vocab_end of the table; other ids give zeros, summed over ranks (exact)."""

    group: Any = None
    vocab_start: int = 0
    vocab_end: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outside = (x < self.vocab_start) | (x >= self.vocab_end)
        y = F.embedding((x - self.vocab_start).masked_fill(outside, 0), self.weight)
        y = y.float().masked_fill(outside.unsqueeze(-1), 0.0)
        dist.all_reduce(y, group=self.group)
        return y.to(self.weight.dtype)


class ExpertParallelMoE(MoE):
    """Routed experts split over ranks. Each rank fills the (token, slot) outputs of the experts it
    holds and leaves the others zero; one all-reduce of those slots (each non-zero on one rank
    only, so the sum is exact) gives every rank all of them, which are then added in the
    one-process order: the routed sum is bitwise the one-process sum, on every rank."""

    group: Any = None

    def route(self, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, rounded: fp8.Rounded | None = None):
        x, weights = into_ranks(x, self.group), into_ranks(weights, self.group)  # this rank's experts read them
        rounded = None if rounded is None else into_ranks(rounded, self.group)
        return super().route(x, weights, indices, rounded)

    def gather_slots(self, contrib: torch.Tensor) -> torch.Tensor:
        return sum_over_ranks(contrib, self.group)


@functools.cache
def expert_parallel(family_moe: type[MoE]) -> type[ExpertParallelMoE]:
    """A family's MoE (model.moe's, model.v3's...) with its routed experts split over ranks: its own
    arithmetic, ExpertParallelMoE's gather."""
    if family_moe is MoE or issubclass(family_moe, ExpertParallelMoE):
        return ExpertParallelMoE if family_moe is MoE else family_moe
    return type(ExpertParallelMoE.__name__, (ExpertParallelMoE, family_moe), {"__doc__": ExpertParallelMoE.__doc__})


def rank_world(group: Any) -> tuple[int, int]:
    """This process's rank in ``group`` and its size (None: the world, one process without one). A
    group is asked itself, so that one made apart from the world works too (tracing.plan runs
    each rank's part alone over a fake group)."""
    if group is None:
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    return group.rank(), group.size()


def _split_mlp(mlp: MLP, group: Any) -> None:
    for name, cls in (("w1", ColumnParallelLinear), ("w3", ColumnParallelLinear), ("w2", RowParallelLinear)):
        _swap(mlp, name, cls, group=group)


def _swap(owner: nn.Module, name: str, cls: type, **attrs: Any) -> None:
    """Put in ``owner.name``'s place a ``cls`` (a subclass of its class that adds the collectives)
    holding the same parameters, submodules and settings, plus ``attrs``."""
    old = getattr(owner, name)
    new = cls.__new__(cls)
    new.__dict__.update(old.__dict__, **attrs)
    setattr(owner, name, new)


# -------------------------------------------------------------------------------------------------
# the plan


def _fits(n: int, world: int, is_fp8: bool) -> str | None:
    """Why ``n`` features cannot be split in ``world`` equal parts, or None."""
    if n % world:
        return f"{n} does not divide by {world} ranks"
    if is_fp8 and (n // world) % fp8.BLOCK:
        return f"{n // world} per rank is not a multiple of the {fp8.BLOCK}-wide FP8 scale block"
    return None


def _linear_parts(prefix: str, linear: Linear, dim: int, rank: int, world: int) -> dict[str, Part]:
    size = (linear.out_features, linear.in_features)[dim]
    step = size // world
    parts = {f"{prefix}.weight": Part(dim, rank * step, (rank + 1) * step)}
    if linear.scale is not None:
        blocks = step // fp8.BLOCK
        parts[f"{prefix}.scale"] = Part(dim, rank * blocks, (rank + 1) * blocks)
    return parts


def _blocks(model: Transformer) -> list[tuple[int, str, nn.Module]]:
    """(index, module path, block) of every block split alike: the main ones, then the MTP module's,
    numbered n_layers + j as the checkpoint numbers it (``split_attention``, :func:`gather_heads`)."""
    found = [(i, f"layers.{i}", block) for i, block in enumerate(model.layers)]
    return found + [(len(model.layers) + j, f"mtp.{j}.block", m.block) for j, m in enumerate(model.mtp)]


def make_plan(model: Transformer, rank: int, world: int, strict: bool = False) -> ParallelPlan:
    """Which part of each parameter rank ``rank`` of ``world`` holds (no collectives, no changes)."""
    args = model.args
    plan = ParallelPlan(rank, world)
    if world == 1:
        plan.experts = range(args.n_routed_experts)
        return plan

    def note(where: str, why: str) -> None:
        plan.notes.append(f"{where} replicated: {why}")

    def split_mlp(prefix: str, mlp: MLP) -> bool:
        why = _fits(mlp.w1.out_features, world, mlp.w1.scale is not None)
        if why:
            note(prefix, f"hidden width {why}")
            return False
        for name, dim in (("w1", 0), ("w3", 0), ("w2", 1)):
            plan.parts.update(_linear_parts(f"{prefix}.{name}", getattr(mlp, name), dim, rank, world))
        return True

    for i, prefix, block in _blocks(model):
        attn = block.attn
        is_fp8 = attn.wq_b.scale is not None
        why = None if attn.n_heads % world == 0 else f"{attn.n_heads} heads do not divide by {world} ranks"
        if why is None:
            h = attn.n_heads // world
            for what, n in (
                ("wq_b rows", h * attn.qk_head_dim),
                ("wkv_b rows", h * (attn.qk_nope_head_dim + attn.v_head_dim)),
                ("wo columns", h * attn.v_head_dim),
            ):
                if is_fp8 and n % fp8.BLOCK:
                    why = f"{what}: {n} per rank is not a multiple of the {fp8.BLOCK}-wide FP8 scale block"
                    break
        if why:
            note(f"{prefix}.attn", why)
        else:
            plan.split_attention.append(i)
            for name, dim in (("wq_b", 0), ("wkv_b", 0), ("wo", 1)):
                plan.parts.update(_linear_parts(f"{prefix}.attn.{name}", getattr(attn, name), dim, rank, world))
        if isinstance(block.ffn, MoE):
            split_mlp(f"{prefix}.ffn.shared_experts", block.ffn.shared_experts)
        else:
            split_mlp(f"{prefix}.ffn", block.ffn)
    n = args.n_routed_experts
    plan.experts = range(n * rank // world, n * (rank + 1) // world)
    if args.vocab_size % world:
        note("embed and head", f"vocabulary {args.vocab_size} does not divide by {world} ranks")
    else:
        step = args.vocab_size // world
        plan.parts["embed.weight"] = plan.parts["head.weight"] = Part(0, rank * step, (rank + 1) * step)
    if strict and plan.notes:
        raise ParallelError("cannot split the model over {} ranks: {}".format(world, "; ".join(plan.notes)))
    return plan


# -------------------------------------------------------------------------------------------------
# applying it


def parallelize(model: Transformer, group: Any = None, strict: bool = False) -> ParallelPlan:
    """Split ``model`` (on the meta device, or loaded) for this rank of ``group`` (default: the
    world); returns the plan. A loaded model keeps its part of each weight; a meta model gets
    parameters of its part's shape, to load with :func:`materialize_parallel` or to stream."""
    rank, world = rank_world(group)
    plan = make_plan(model, rank, world, strict)
    plan.group = group
    if world == 1:
        return plan
    for name, part in plan.parts.items():
        *path, leaf = name.split(".")
        owner = model.get_submodule(".".join(path))
        old = owner._parameters[leaf]
        new = old.detach().narrow(part.dim, part.start, part.stop - part.start)
        owner._parameters[leaf] = nn.Parameter(new if new.is_meta else new.clone(), requires_grad=False)
    for m in model.modules():  # shapes the forward reads from attributes
        if isinstance(m, Linear):
            m.out_features, m.in_features = m.weight.shape
    for i, prefix, block in _blocks(model):
        if i in plan.split_attention:
            block.attn.n_heads //= world  # local heads, the reference's n_local_heads
            _swap(block.attn, "wo", RowParallelLinear, group=group)
            for name in ("wq_b", "wkv_b"):
                _swap(block.attn, name, ColumnParallelLinear, group=group)
        if isinstance(block.ffn, MoE):
            moe = block.ffn
            for j in range(len(moe.experts)):
                if j not in plan.experts:
                    moe.experts[j] = None
            _swap(block, "ffn", expert_parallel(type(moe)), group=group)
            if f"{prefix}.ffn.shared_experts.w2.weight" in plan.parts:
                _split_mlp(moe.shared_experts, group)
        elif f"{prefix}.ffn.w2.weight" in plan.parts:
            _split_mlp(block.ffn, group)
    if "embed.weight" in plan.parts:
        part = plan.parts["embed.weight"]
        _swap(model, "embed", VocabParallelEmbedding, group=group, vocab_start=part.start, vocab_end=part.stop)
        _swap(model, "head", ColumnParallelHead, group=group)
    return plan


def materialize_parallel(model: Transformer, source: WeightSource, plan: ParallelPlan, device: torch.device | str) -> int:
    """Assign this rank's part of every parameter of a parallelized meta model; returns bytes read."""
    reader = TensorReader(source)
    try:
        validate(model, source, parts=plan.parts)
        for name, param in list(model.named_parameters()):
            tensor = reader.read(to_hf(name, model.args.n_layers), device, plan.parts.get(name)).to(param.dtype)
            *path, leaf = name.split(".")
            model.get_submodule(".".join(path))._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        return reader.bytes_read
    finally:
        reader.close()


def load_parallel(
    source: WeightSource,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    group: Any = None,
    strict: bool = False,
    mtp: bool | None = None,
) -> tuple[Transformer, ParallelPlan]:
    """This rank's part of the model, ready to run: build on meta, split, read only this part.
    ``mtp``: the checkpoint's MTP module, split like a block (None: when the checkpoint has one)."""
    model = build_model(source.args, dtype, mtp=wants_mtp(source, mtp))
    plan = parallelize(model, group, strict)
    materialize_parallel(model, source, plan, device)
    check_mtp_copies(model, source, plan.parts)
    return model.eval(), plan


# -------------------------------------------------------------------------------------------------
# torchrun and rank-local values


@dataclass(frozen=True)
class Distributed:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    group: Any


def init_distributed(device: torch.device | str | None = None, timeout: timedelta | None = None) -> Distributed | None:
    """Join the process group ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*):
    NCCL on CUDA (one GPU per local rank), gloo on CPU. None when not launched with several ranks.
    ``timeout``: how long a collective waits for a rank (torch's default otherwise): a server sets it
    short, so that a rank that died ends the others."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return None
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device(device) if device is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        if dev.type == "cuda":
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=dev, timeout=timeout)
        else:
            dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    return Distributed(rank, world, local_rank, dev, dist.group.WORLD)


def broadcast_int(value: int, group: Any = None) -> int:
    """Rank 0's ``value`` on every rank (a seed drawn once, shared)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.broadcast(t, src=0, group=group)
    return int(t.item())


def model_groups(model_ranks: int) -> tuple[Any, Any, int]:
    """The 2-D layout of a world of W ranks: replicas of ``model_ranks`` consecutive ranks each (the
    model split over a node's GPUs), and the group of each replica's first rank (the batches shared
    between replicas are added there). Returns (this rank's model group, the leaders' group, this
    rank's replica). Every rank makes every group, in the same order, as torch.distributed asks."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if model_ranks < 1 or world % model_ranks:
        raise ParallelError(f"--model-ranks {model_ranks}: the {world} ranks do not split into groups of that size")
    groups = [dist.new_group(list(range(r * model_ranks, (r + 1) * model_ranks))) for r in range(world // model_ranks)]
    leaders = dist.new_group(list(range(0, world, model_ranks)))
    return groups[rank // model_ranks], leaders, rank // model_ranks


def gather_heads(value: torch.Tensor, plan: ParallelPlan | None, block: int, group: Any = None) -> torch.Tensor:
    """All heads (dim 2) of a per-head value of ``block`` (the tracing registry says which sites are
    per head), as one process sees it. A collective where the block's heads are split: every rank
    must call it, in the same order; returned as it is where they are not."""
    if plan is None or plan.world == 1 or block not in plan.split_attention:
        return value
    value = value.contiguous()
    parts = [torch.empty_like(value) for _ in range(plan.world)]
    dist.all_gather(parts, value, group=group if group is not None else plan.group)
    return torch.cat(parts, dim=2)  # (B, T, H, S)


__all__ = [
    "ColumnParallelHead",
    "ColumnParallelLinear",
    "Distributed",
    "ExpertParallelMoE",
    "ParallelError",
    "ParallelPlan",
    "Part",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "broadcast_int",
    "gather_heads",
    "init_distributed",
    "load_parallel",
    "make_plan",
    "model_groups",
    "materialize_parallel",
    "parallelize",
    "rank_world",
]
