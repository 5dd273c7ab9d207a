"""Hook points: identity modules that give each internal value a stable dotted name.

The model calls ``self.some_point(tensor)`` where a value worth seeing exists; the trace name is the
module path (``layers.3.ffn.gate.topk_indices``). Forward hooks registered on a point may read the
value, or return a replacement (a patch), which the model then uses instead: code downstream of a
point always consumes the point's output.
"""

from __future__ import annotations

import torch
from torch import nn


class HookPoint(nn.Module):
    """Identity; ``shape`` documents the layout, e.g. ``"B T D"`` (B is dropped in traces)."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @property
    def observed(self) -> bool:
        """True while some hook is registered: values that exist only for the trace are computed."""
        return bool(self._forward_hooks)

    def extra_repr(self) -> str:
        return self.shape
