"""Where a run or a trace first holds NaN or an infinity that no mask explains.

One bad value upstream spoils everything downstream, and a trace file says nothing about its own
health: the CLI notes the first such site in the trace's metadata and on stderr, the app warns.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from model.config import ModelArgs

from .sites import site_shapes

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


def first_nonfinite(tensors: Mapping[str, torch.Tensor], config: ModelArgs, n_tokens: int) -> NonFinite | None:
    """The earliest site, in the order the model computes them, holding a non-finite value, and the
    first position there."""
    rank = {name: i for i, name in enumerate(site_shapes(config))}
    for name in sorted(tensors, key=lambda n: _forward_order(n, rank, config.n_layers)):
        value = tensors[name]
        if not value.is_floating_point() or not value.numel() or _clean(value, name.endswith(MASKED_WITH_INF)):
            continue
        bad = value.isnan() | (value == float("inf"))
        if not name.endswith(MASKED_WITH_INF):
            bad |= value == float("-inf")
        if not bad.any():
            continue
        by_position = name != "logits.last" and value.dim() >= 1 and value.shape[0] == n_tokens
        position = int(bad.reshape(value.shape[0], -1).any(-1).nonzero()[0, 0]) if by_position else None
        return NonFinite(name, position)
    return None
