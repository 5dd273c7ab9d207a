"""Small numerical helpers shared by the layers."""

from __future__ import annotations

import torch

_LOW = (torch.bfloat16, torch.float16)


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """torch.einsum, in float32 on the CPU for 16-bit inputs, rounded back to their dtype.

    GPUs multiply bfloat16 with float32 accumulation and round the result; CPUs without bf16 units
    are ~100x slower in bfloat16, so the same products are formed in float32 and rounded once.
    """
    dtype = operands[0].dtype
    if operands[0].device.type == "cpu" and dtype in _LOW:
        return torch.einsum(equation, *(x.float() for x in operands)).to(dtype)
    return torch.einsum(equation, *operands)


def topk(x: torch.Tensor, k: int, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values along ``dim`` and their indices, best first; among equal values the
    lower index wins, as CUDA's top-k fills ties in index order (CPU top-k leaves ties unordered).
    Index scores tie often: the ReLU makes whole rows of exact zeros."""
    values, indices = torch.sort(x, dim=dim, descending=True, stable=True)
    return values.narrow(dim, 0, k), indices.narrow(dim, 0, k)
