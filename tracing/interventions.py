"""Ready-made interventions: ablate experts, route without the correction bias, change the
indexer's top-k (dense attention is top-k >= T). Each is a set of hook-point replacements, applied
by the Tracer in the tracing thread only, so a shared model is never modified.

Patches (a site name -> a value) are the general form; these build their replacement from the
value the model computed in the same forward pass.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from model.config import ModelArgs
from model.moe import RouterRule, select_experts
from model.ops import topk

from .errors import InputError
from .sites import site_name

# a replacement: (the point's output, values already seen in this pass) -> new output or None
Replace = Callable[[torch.Tensor, dict[str, torch.Tensor]], torch.Tensor | None]


@dataclass(frozen=True)
class Intervention:
    """Base: ``replacements(args)`` maps hook-point names to functions computing the new value."""

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        raise NotImplementedError

    def config(self, args: ModelArgs) -> ModelArgs:
        """The config the run is equivalent to (what the trace records)."""
        return args

    def describe(self) -> str:
        return type(self).__name__


def _moe_layers(args: ModelArgs, layers: tuple[int, ...] | None) -> list[int]:
    chosen = range(args.n_dense_layers, args.n_layers) if layers is None else layers
    for layer in chosen:
        if not args.n_dense_layers <= layer < args.n_layers:
            raise InputError(f"block {layer} is not a MoE block (MoE blocks: {args.n_dense_layers}..{args.n_layers - 1})")
    return list(chosen)


@dataclass(frozen=True)
class AblateExperts(Intervention):
    """Experts that are never chosen: masked out of the biased scores before groups and top-k,
    so routing goes around them as if they did not exist."""

    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> expert ids

    @classmethod
    def parse(cls, text: str) -> AblateExperts:
        """``LAYER:EXPERT,LAYER:EXPERT,...`` (e.g. ``3:17,3:40,5:2``)."""
        experts: dict[int, list[int]] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            layer, sep, expert = item.partition(":")
            if not sep or not layer.strip().isdigit() or not expert.strip().isdigit():
                raise InputError(f"--ablate-experts {item!r}: expected LAYER:EXPERT, e.g. 3:17")
            experts.setdefault(int(layer), []).append(int(expert))
        if not experts:
            raise InputError("--ablate-experts: no LAYER:EXPERT given")
        return cls({layer: tuple(sorted(set(ids))) for layer, ids in experts.items()})

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer in _moe_layers(args, tuple(self.experts)):
            ids = self.experts[layer]
            if any(not 0 <= e < args.n_routed_experts for e in ids):
                raise InputError(f"block {layer}: experts are numbered 0..{args.n_routed_experts - 1}")
            if args.n_routed_experts - len(ids) < args.n_activated_experts:
                raise InputError(f"block {layer}: ablating {len(ids)} experts leaves fewer than k={args.n_activated_experts}")

            def mask(value, seen, ids=ids):
                out = value.clone()
                out[..., list(ids)] = float("-inf")
                return out

            out[site_name(layer, "ffn.gate.biased_scores")] = mask
        return out

    def describe(self) -> str:
        return "ablate " + ", ".join(f"{layer}:{e}" for layer, ids in sorted(self.experts.items()) for e in ids)


@dataclass(frozen=True)
class NoGateBias(Intervention):
    """Route without the correction bias: choose by the unbiased scores, groups ranked by their
    best expert, as the reference's router does when it has no bias."""

    layers: tuple[int, ...] | None = None

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        rule = RouterRule.of(args)
        for layer in _moe_layers(args, self.layers):
            site = site_name(layer, "ffn.gate")
            out[f"{site}.biased_scores"] = lambda value, seen, s=site: seen[f"{s}.scores"]
            out[f"{site}.group_scores"] = lambda value, seen, s=site: (
                select_experts(seen[f"{s}.biased_scores"], None, rule).group_scores
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
        if self.k <= 0:
            raise InputError("--index-topk must be positive")
        out: dict[str, Replace] = {}
        for layer in range(args.n_layers):
            site = site_name(layer, "attn.indexer")

            def select(value, seen, s=site):
                scores = seen[f"{s}.scores"]  # (B, T, S), -inf where masked
                values, indices = topk(scores, min(self.k, scores.shape[-1]))
                return indices.masked_fill(values == float("-inf"), -1)

            out[f"{site}.topk_indices"] = select
        return out

    def config(self, args: ModelArgs) -> ModelArgs:
        return args.replace(index_topk=min(self.k, args.max_seq_len))

    def describe(self) -> str:
        return "dense attention" if self.k >= 1 << 30 else f"index_topk={self.k}"


def from_spec(spec: Mapping[str, Any]) -> list[Intervention]:
    """The interventions a spec of plain values asks for, in the order they apply: the command line
    makes one from its flags, the app from its widgets (and keeps it, to run it again).

    * ``ablate``: ``"LAYER:EXPERT,..."`` or ``{block: [experts]}``; empty or absent: none
    * ``no_bias``: ``None``, ``"all"`` or ``[blocks]``
    * ``attention``: ``None`` (the model's index_topk), ``"dense"`` or another index_topk

    Each intervention checks its values against the model when it runs.
    """
    out: list[Intervention] = []
    ablate = spec.get("ablate")
    if isinstance(ablate, str) and ablate:
        out.append(AblateExperts.parse(ablate))
    elif ablate:
        out.append(AblateExperts({int(block): tuple(ids) for block, ids in ablate.items()}))
    no_bias = spec.get("no_bias")
    if no_bias is not None:
        out.append(NoGateBias(None if no_bias == "all" else tuple(no_bias)))
    attention = spec.get("attention")
    if attention == "dense":
        out.append(IndexTopK.dense())
    elif attention is not None:
        out.append(IndexTopK(int(attention)))
    return out
