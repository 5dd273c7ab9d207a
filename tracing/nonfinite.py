"""Where a run or a trace first holds NaN or an infinity that no mask explains.

One bad value upstream spoils everything downstream, and a trace file says nothing about its own
health: the CLI notes the first such site in the trace's metadata and on stderr, the app warns.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass

import torch

from model.config import ModelArgs

from .sites import site_name, site_shapes

# -inf is how these sites mark the keys a query may not see; anywhere else it is as wrong as NaN
MASKED_WITH_INF = ("attn.indexer.scores", "attn.scores")
# a block's sites in the order it computes them (each stage in site_shapes' order inside it)
_STAGES = ("resid_pre", "attn.", "attn_out", "resid_mid", "ffn.", "ffn_out", "resid_post")


@dataclass(frozen=True)
class NonFinite:
    site: str
    position: int | None  # the token position; None for a site not laid out by position (logits.last)

    def as_dict(self) -> dict:
        return asdict(self)


def _forward_order(name: str, rank: dict[str, int], n_layers: int) -> tuple[int, int, int]:
    """A sort key that follows the computation: block by block, each block's stages in order, the
    final logits last (a file's tensors, and site_shapes, list them in other orders)."""
    parts = name.split(".", 2)
    if parts[0] != "layers" or len(parts) < 3 or not parts[1].isdigit():
        return (n_layers, 0, rank.get(name, len(rank)))
    stage = next((i for i, prefix in enumerate(_STAGES) if parts[2].startswith(prefix)), len(_STAGES))
    return (int(parts[1]), stage, rank.get(name, len(rank)))


def _clean(value: torch.Tensor, masked: bool) -> bool:
    """No NaN or infinity (-inf allowed where ``masked``), from the extremes alone (NaN propagates
    through both): one or two reductions, no tensor of flags, for the many values that are clean."""
    top = float(value.amax())
    return top < float("inf") if masked else top < float("inf") and float(value.amin()) > float("-inf")


def intervention_masks(interventions: Iterable) -> set[str]:
    """The sites where an intervention writes -inf itself: ablated experts leave the biased scores
    (and a group left without two experts, its group score) at -inf, which says nothing of the
    model's health and must not hide a later NaN."""
    from .analyses.interventions import AblateExperts

    out = set()
    for intervention in interventions:
        if isinstance(intervention, AblateExperts):
            out |= {site_name(b, s) for b in intervention.experts for s in ("ffn.gate.biased_scores", "ffn.gate.group_scores")}
    return out


def first_nonfinite(
    tensors: Mapping[str, torch.Tensor], config: ModelArgs, n_tokens: int, masked: Collection[str] = ()
) -> NonFinite | None:
    """The earliest site, in the order the model computes them, holding a non-finite value, and the
    first position there; -inf is allowed at the masking sites and at ``masked``
    (:func:`intervention_masks`)."""
    rank = {name: i for i, name in enumerate(site_shapes(config))}
    for name in sorted(tensors, key=lambda n: _forward_order(n, rank, config.n_layers)):
        value = tensors[name]
        inf_ok = name.endswith(MASKED_WITH_INF) or name in masked
        if not value.is_floating_point() or not value.numel() or _clean(value, inf_ok):
            continue
        bad = value.isnan() | (value == float("inf"))
        if not inf_ok:
            bad |= value == float("-inf")
        if not bad.any():
            continue
        by_position = name != "logits.last" and value.dim() >= 1 and value.shape[0] == n_tokens
        position = int(bad.reshape(value.shape[0], -1).any(-1).nonzero()[0, 0]) if by_position else None
        return NonFinite(name, position)
    return None
