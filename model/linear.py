"""The linear layer: FP8 e4m3 weights with 128x128 block scales, or plain 16/32-bit weights."""

from __future__ import annotations

import torch
from torch import nn

from . import fp8, kernels


class Linear(nn.Module):
    """y = x W^T. FP8 weights carry ``scale`` (the checkpoint's ``weight_scale_inv``, one float32 per
    128x128 block, edge blocks partial) and the input is quantised per 128 values first, as the
    reference's ``fp8_gemm`` does (:func:`model.kernels.linear`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        dtype: torch.dtype = torch.bfloat16,
        scale_fmt: str | None = None,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.scale_fmt = scale_fmt
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=dtype != fp8.FP8)
        if dtype == fp8.FP8:
            self.scale = nn.Parameter(
                torch.empty(fp8.scale_shape((out_features, in_features)), dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("scale", None)

    def forward(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        return kernels.linear(x, self.weight, self.scale, self.scale_fmt)

    def rounded(self, x: torch.Tensor) -> torch.Tensor | fp8.Rounded:
        """x as this layer's product reads it: rounded through FP8 for FP8 weights (fp8.Rounded, to
        hand to the other FP8 products of the same input: rows round independently), else x itself
        (also inside fp8.unrounded_activations)."""
        return x if self.scale is None else fp8.rounded(x, self.scale_fmt)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (what the reference's ``weight_dequant`` gives for the MQA decode)."""
        return kernels.weight_dequant(self.weight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"
