"""The linear layer: FP8 e4m3 weights with 128x128 block scales, or plain 16/32-bit weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8


class Linear(nn.Module):
    """y = x W^T. FP8 weights carry ``scale`` (the checkpoint's ``weight_scale_inv``, one float32 per
    128x128 block, edge blocks partial) and the input is quantised per 128 values first, as the
    reference's ``fp8_gemm`` does.

    On the CPU the weight is kept in float32 after first use and products are formed in float32
    (FP8 to float conversion is slow there, and CPUs without bf16 units multiply bfloat16 ~5-100x
    slower), rounded once to the activation dtype; ``cache_dequantized = False`` turns the copy off.
    """

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
        self.cache_dequantized = True
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=dtype != fp8.FP8)
        if dtype == fp8.FP8:
            self.scale = nn.Parameter(
                torch.empty(fp8.scale_shape((out_features, in_features)), dtype=torch.float32), requires_grad=False
            )
        else:
            self.register_parameter("scale", None)
        self._dequantized: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        if isinstance(x, fp8.Rounded):  # FP8 weights, input rounded once for several products
            return fp8.fp8_gemm(x.values, self.weight, self.scale, self.scale_fmt, x.dtype, self._cached_weight(), quantized=True)
        if self.scale is not None:
            return fp8.fp8_gemm(x, self.weight, self.scale, self.scale_fmt, x.dtype, self._cached_weight())
        cached = self._cached_weight()
        if cached is not None:
            return F.linear(x.float(), cached).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype))

    def _cached_weight(self) -> torch.Tensor | None:
        """The float32 weight on the CPU (None on GPUs, or while the weight is being trained)."""
        weight = self.weight
        if not self.cache_dequantized or weight.device.type != "cpu" or weight.requires_grad:
            return None
        if weight.dtype == torch.float32:
            return weight.detach()
        cached = self._dequantized
        if cached is None or cached[0] is not weight or cached[1] is not self.scale:
            value = weight.detach().float() if self.scale is None else fp8.weight_dequant(weight, self.scale)
            cached = (weight, self.scale, value)
            self._dequantized = cached
        return cached[2]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (what the reference's ``weight_dequant`` gives for the MQA decode)."""
        if self.scale is None:
            return self.weight.to(dtype)
        cached = self._cached_weight()
        return cached.to(dtype) if cached is not None else fp8.weight_dequant(self.weight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"
