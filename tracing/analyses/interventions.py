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
from model.kernels import topk
from model.moe import RouterRule, select_experts

from ..errors import InputError
from ..sites import site_name

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


def _pairs(flag: str, what: str, text: str) -> dict[int, tuple[int, ...]]:
    """``LAYER:ID,LAYER:ID,...`` as block -> sorted distinct ids (experts or heads)."""
    chosen: dict[int, list[int]] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        layer, sep, index = item.partition(":")
        if not sep or not layer.strip().isdigit() or not index.strip().isdigit():
            raise InputError(f"{flag} {item!r}: expected LAYER:{what}, e.g. 3:17")
        chosen.setdefault(int(layer), []).append(int(index))
    if not chosen:
        raise InputError(f"{flag}: no LAYER:{what} given")
    return {layer: tuple(sorted(set(ids))) for layer, ids in chosen.items()}


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

    @classmethod
    def parse(cls, text: str) -> AblateExperts:
        """``LAYER:EXPERT,LAYER:EXPERT,...`` (e.g. ``3:17,3:40,5:2``)."""
        return cls(_pairs("--ablate-experts", "EXPERT", text))

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in _checked_experts(args, self.experts):
            if args.n_routed_experts - len(ids) < args.n_activated_experts:
                raise InputError(f"block {layer}: ablating {len(ids)} experts leaves fewer than k={args.n_activated_experts}")

            def mask(value, seen, ids=ids):
                out = value.clone()
                out[..., list(ids)] = float("-inf")
                return out

            out[site_name(layer, "ffn.gate.biased_scores")] = mask
        return out

    def describe(self) -> str:
        return "ablate " + _listing(self.experts)


@dataclass(frozen=True)
class ZeroExperts(Intervention):
    """Experts that are still chosen but contribute nothing: their weighted outputs are zeroed
    before the routed sum, so routing (and every other expert's weight) stays as it was."""

    experts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> expert ids

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in _checked_experts(args, self.experts):
            chosen = site_name(layer, "ffn.gate.topk_indices")

            def zero(value, seen, chosen=chosen, ids=ids):
                slots = seen[chosen].sort(dim=-1).values  # (N, k): expert_out's slots, ascending
                silent = torch.isin(slots, torch.tensor(ids, device=slots.device))
                return value.masked_fill(silent.unsqueeze(-1), 0.0)  # (N, k, D)

            out[site_name(layer, "ffn.expert_out")] = zero
        return out

    def describe(self) -> str:
        return "zero " + _listing(self.experts)


@dataclass(frozen=True)
class AblateHeads(Intervention):
    """Attention heads whose output is zero before ``wo``: their probabilities are zeroed, so the
    head reads no value (in the prefill and in the decode path alike); ``wo`` then rounds its input,
    the zeros included, as it would any other."""

    heads: dict[int, tuple[int, ...]] = field(default_factory=dict)  # block -> head ids

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        out: dict[str, Replace] = {}
        for layer, ids in self.heads.items():
            if not 0 <= layer < args.n_layers:
                raise InputError(f"--ablate-heads: blocks are numbered 0..{args.n_layers - 1}")
            if any(not 0 <= h < args.n_heads for h in ids):
                raise InputError(f"block {layer}: heads are numbered 0..{args.n_heads - 1}")

            def zero(value, seen, ids=ids):
                if value.shape[2] != args.n_heads:
                    raise InputError("--ablate-heads: a rank holds only its heads under tensor parallelism")
                out = value.clone()
                out[:, :, list(ids)] = 0.0  # (B, T, H, S)
                return out

            out[site_name(layer, "attn.probs")] = zero
        return out

    def describe(self) -> str:
        return "ablate heads " + _listing(self.heads)


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
            out[biased] = lambda value, seen, scores=scores: seen[scores]
            out[site_name(layer, "ffn.gate.group_scores")] = lambda value, seen, biased=biased: (
                select_experts(seen[biased], None, rule).group_scores
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
            name = site_name(layer, "attn.indexer.scores")

            def select(value, seen, name=name):
                scores = seen[name]  # (B, T, S), -inf where masked
                values, indices = topk(scores, min(self.k, scores.shape[-1]))
                return indices.masked_fill(values == float("-inf"), -1)

            out[site_name(layer, "attn.indexer.topk_indices")] = select
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
    * ``zero_experts``, ``ablate_heads``: as ``ablate`` (``"LAYER:ID,..."`` or ``{block: [ids]}``)

    Each intervention checks its values against the model when it runs.
    """
    out: list[Intervention] = []
    ablate = spec.get("ablate")
    if isinstance(ablate, str) and ablate:
        out.append(AblateExperts.parse(ablate))
    elif ablate:
        out.append(AblateExperts({int(block): tuple(ids) for block, ids in ablate.items()}))
    for key, kind, what in (("zero_experts", ZeroExperts, "EXPERT"), ("ablate_heads", AblateHeads, "HEAD")):
        value = spec.get(key)  # "LAYER:ID,..." (the flag's text) or {block: [ids]}
        if isinstance(value, str) and value:
            out.append(kind(_pairs("--" + key.replace("_", "-"), what, value)))
        elif value:
            out.append(kind({int(block): tuple(sorted(set(ids))) for block, ids in value.items()}))
    no_bias = spec.get("no_bias")
    if no_bias is not None:
        out.append(NoGateBias(None if no_bias == "all" else tuple(no_bias)))
    attention = spec.get("attention")
    if attention == "dense":
        out.append(IndexTopK.dense())
    elif attention is not None:
        out.append(IndexTopK(int(attention)))
    return out
