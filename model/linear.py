"""The linear layer: FP8 e4m3 weights with 128x128 block scales, or plain 16/32-bit weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8, ops


class Linear(nn.Module):
    """y = x W^T. FP8 weights carry ``scale`` (the checkpoint's ``weight_scale_inv``, one float32 per
    128x128 block, edge blocks partial) and the input is quantised per 128 values first, as the
    reference's ``fp8_gemm`` does.

    On the CPU, products are formed in :func:`model.ops.product_dtype` of the activations (bfloat16
    where the CPU has bf16 units, else float32) and rounded once to the activation dtype; FP8
    weights are kept dequantised in that dtype after first use (FP8 to float conversion is slow on
    the CPU; e4m3 times a power-of-two scale is exact in both), and a bfloat16 copy also laid out
    for oneDNN (:func:`model.ops.pack`: the same bits). ``cache_dequantized = False`` turns the
    copies off (the streamer does, so freed weights are not held).
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
        self._cached: dict[torch.dtype, tuple] = {}  # product dtype -> (weight, scale, copy): see _prepared
        self._packed: dict[torch.dtype, tuple] = {}  # copy dtype -> (copy, ops.pack(copy))
        self._fast_at: tuple[int, bool] | None = None  # (scale's data_ptr, fast): see _fast

    def forward(self, x: torch.Tensor | fp8.Rounded) -> torch.Tensor:
        fast, copy = self._prepared(x.dtype)
        packed = None if copy is None else self._pack(copy)
        if self.scale is not None:  # FP8: x may be rounded already (fp8.Rounded, shared by several products)
            return fp8.fp8_gemm(x, self.weight, self.scale, self.scale_fmt, fast, copy, packed)
        if copy is not None:
            return ops.linear(x.to(copy.dtype), copy, packed).to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype))

    def rounded(self, x: torch.Tensor) -> torch.Tensor | fp8.Rounded:
        """x as this layer's product reads it: rounded through FP8 for FP8 weights (fp8.Rounded, to
        hand to the other FP8 products of the same input), else x itself."""
        return x if self.scale is None else fp8.Rounded.of(x, self.scale_fmt)

    def _pack(self, copy: torch.Tensor) -> torch.Tensor | None:
        """ops.pack of this copy, made once (a bfloat16 copy only)."""
        known = self._packed.get(copy.dtype)
        if known is None or known[0] is not copy:
            known = self._packed[copy.dtype] = (copy, ops.pack(copy))
        return known[1]

    def _prepared(self, dtype: torch.dtype = torch.float32) -> tuple[bool | None, torch.Tensor | None]:
        """Whether the FP8 product may dequantise first (fp8.fp8_gemm's ``fast``; None for 16/32-bit
        weights), and, on the CPU, a copy of what the product of ``dtype`` activations multiplies, in
        the dtype it is formed in: the dequantised weight when fast, the FP8 codes in float32
        otherwise (the kernel's block order), the weight itself where it has that dtype. Made once
        per weight tensor and product dtype; not while the weight is trained or streamed."""
        weight, scale = self.weight, self.scale
        fast = self._fast()
        if not self.cache_dequantized or weight.device.type != "cpu" or weight.requires_grad:
            return fast, None
        compute = torch.float32 if fast is False else ops.product_dtype(dtype)
        cached = self._cached.get(compute)
        if cached is not None and cached[0] is weight and cached[1] is scale:
            return fast, cached[2]
        if weight.dtype == compute:
            copy = weight.detach()  # the weight itself (kept, so that its packed copy is found again)
        elif scale is None:
            copy = weight.detach().to(compute)
        else:
            copy = fp8.weight_dequant(weight, scale, compute) if fast else fp8.to_float(weight.detach())
        self._cached[compute] = (weight, scale, copy)
        return fast, copy

    def _fast(self) -> bool | None:
        """fp8.dequantise_first_is_exact for this weight's scales, worked out once per scale tensor.
        Remembered by the scale's address, not a reference, so streamed weights stay freeable (a
        scale is reloaded from the same checkpoint tensor)."""
        scale = self.scale
        if scale is None or scale.is_meta:
            return None
        known = self._fast_at
        if known is None or known[0] != scale.data_ptr():
            known = self._fast_at = (scale.data_ptr(), fp8.dequantise_first_is_exact(scale, self.scale_fmt))
        return known[1]

    def drop_copy(self, dtype: torch.dtype) -> None:
        """Forget the copy products of ``dtype`` activations multiply (its owner keeps what it needs:
        a MoE block its experts' packed weights); it is made again if asked for."""
        compute = ops.product_dtype(dtype)
        self._cached.pop(compute, None)
        self._packed.pop(compute, None)

    def share_copy(self, copy: torch.Tensor) -> None:
        """Hold ``copy`` (equal to this Linear's own copy of its dtype, e.g. a view into the stack of
        a MoE block's experts) in place of the copy; nothing is copied."""
        _, own = self._prepared(copy.dtype)
        if own is None or own.dtype != copy.dtype or not torch.equal(own, copy):
            raise ValueError("share_copy: not this Linear's copy")
        self._cached[copy.dtype] = (self.weight, self.scale, copy)
        self._packed.pop(copy.dtype, None)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` (what the reference's ``weight_dequant`` gives for the MQA decode)."""
        if self.scale is None:
            return self.weight.to(dtype)
        fast, copy = self._prepared(dtype)
        return copy.to(dtype) if fast and copy is not None else fp8.weight_dequant(self.weight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, dtype={self.weight.dtype}"
