"""RMSNorm with the fused residual add, and the indexer's LayerNorm."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32, result in ``dtype`` (default: the input's).

    The gain is a float32 parameter, as the reference creates it and the checkpoint stores it:
    rounding it to bfloat16 moves every normalised value (a 2-4% relative change of a block's
    update on real weights). The reference fuses the residual add into this norm: ``x + residual`` is formed in float32,
    normalised as such and handed on rounded to bfloat16. The blocks keep that order (see
    ``Block.add_norm``) and give the float32 sum a name in between.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or x.dtype
        x = x.float()
        var = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(var + self.eps)
        return (self.weight * x).to(dtype)


class LayerNorm(nn.Module):
    """LayerNorm in float32 (the indexer's key norm), result in the input's dtype; weight and bias
    are float32 parameters, as the reference's and the checkpoint's."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (self.dim,), self.weight, self.bias, self.eps).type_as(x)
