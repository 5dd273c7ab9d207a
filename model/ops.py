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
