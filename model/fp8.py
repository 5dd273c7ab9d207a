"""FP8 e4m3 with 128-blocks, exactly as the reference's kernels round it; one module for all of it.

Shapes: M rows of activations, K input features, N output features, 128-wide blocks.

The reference's tilelang kernels (``act_quant``, ``fp8_gemm``, ``fp8_index``) are GPU-only; these are
plain PyTorch functions with the same rounding: activation scales are ``amax / 448`` (amax clamped
below at 1e-4), or the next power of two when ``scale_fmt`` is ``ue8m0``; values are divided by their
block's scale, clamped to +-448 and rounded to e4m3. A block-scaled product multiplies each 128-wide
partial dot product by both scales, accumulating in float32. Here the two operands are dequantised
first (exact for power-of-two scales) and multiplied in float32 on the CPU, or in bfloat16 on CUDA
when that is exact too (ue8m0 scales): the same products, summed in another order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The kernel multiplies by 1/448 rounded to float32; dividing by 448 can differ in the last bit.
# (a Python float holding the float32 value: a float32 tensor times a Python scalar multiplies in float32)
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive float32 x, from the exponent bits as the kernel computes it."""
    bits = x.view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return ((exponent + 127) << 23).view(torch.float32)


def act_scale(amax: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """Per-block scale from the block's absolute maximum (float32)."""
    scale = amax.float().clamp(min=1e-4) * _FP8_MAX_INV
    return _pow2_ceil(scale) if scale_fmt else scale


def act_quant(x: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dimension in blocks of 128: (fp8 values, float32 scale per block)."""
    *lead, k = x.shape
    if k % BLOCK:
        raise ValueError(f"act_quant: last dimension {k} is not a multiple of {BLOCK}")
    blocks = x.float().reshape(*lead, k // BLOCK, BLOCK)  # (..., K/128, 128)
    scale = act_scale(blocks.abs().amax(dim=-1), scale_fmt)  # (..., K/128)
    y = (blocks / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return y.reshape(x.shape), scale


def act_dequant(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of act_quant's output."""
    *lead, k = y.shape
    blocks = y.float().reshape(*lead, k // BLOCK, BLOCK) * scale.unsqueeze(-1)
    return blocks.reshape(y.shape)


def fake_quant(x: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """x rounded through act_quant and back, in x's dtype (the reference's FP8 KV simulation)."""
    return act_dequant(*act_quant(x, scale_fmt)).to(x.dtype)


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """One scale per weight element from one per 128x128 block; edge blocks may be partial."""
    rows, cols = shape
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 weight [N, K] times its block scales [ceil(N/128), ceil(K/128)]."""
    check_scale_shape(weight.shape, scale.shape)
    return (weight.float() * expand_scale(scale.float(), weight.shape)).to(dtype)


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    rows, cols = shape
    return (-(-rows // BLOCK), -(-cols // BLOCK))


def check_scale_shape(weight_shape: torch.Size | tuple[int, ...], scale_shape_: torch.Size | tuple[int, ...]) -> None:
    want = scale_shape(weight_shape)
    if tuple(scale_shape_) != want:
        raise ValueError(f"scale shape {tuple(scale_shape_)} does not fit weight {tuple(weight_shape)}: expected {want}")


def weight_quant(weight: torch.Tensor, scale_fmt: str | None = "ue8m0") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [N, K] per 128x128 block: (fp8 weight, float32 scale_inv), fp8 * scale ~ weight."""
    rows, cols = weight.shape
    n_r, n_c = scale_shape(weight.shape)
    padded = weight.float().new_zeros(n_r * BLOCK, n_c * BLOCK)
    padded[:rows, :cols] = weight.float()
    amax = padded.view(n_r, BLOCK, n_c, BLOCK).abs().amax(dim=(1, 3))  # (N/128, K/128)
    scale = act_scale(amax, scale_fmt)
    q = (weight.float() / expand_scale(scale, weight.shape)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _exact_in_bf16(scale: torch.Tensor | None) -> bool:
    # fp8 * 2**e has at most 4 significant bits: exact in bfloat16 unless the exponent overflows.
    return scale is None or bool(torch.all(_pow2_ceil(scale.float()) == scale))


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_fmt: str | None,
    out_dtype: torch.dtype,
    dequantized: torch.Tensor | None = None,
    quantized: bool = False,
) -> torch.Tensor:
    """y = act_quant(x) @ weight.T with block scales; ``dequantized`` is a cached float weight.

    ``quantized``: x is already act_quant's result, dequantised to float32 (:func:`act_round`), as
    when many products share one input: the rounding is per row, so rounding the rows once and
    selecting them gives what rounding the selection would.
    """
    a = x if quantized else act_dequant(*act_quant(x, scale_fmt))  # float32 values on the FP8 grid
    if x.is_cuda and scale_fmt and _exact_in_bf16(scale):
        # both operands exact in bfloat16: cuBLAS multiplies exactly and accumulates in float32
        w = dequantized if dequantized is not None else weight_dequant(weight, scale, torch.bfloat16)
        return torch.matmul(a.to(torch.bfloat16), w.to(torch.bfloat16).t()).to(out_dtype)
    w = dequantized if dequantized is not None else weight_dequant(weight, scale)
    return torch.matmul(a.float(), w.float().t()).to(out_dtype)


def act_round(x: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """x rounded through act_quant, as float32 values (the input an FP8 product actually sees)."""
    return act_dequant(*act_quant(x, scale_fmt))


@dataclass(frozen=True)
class Rounded:
    """An activation already rounded through act_quant (float32 values on the FP8 grid) and the
    dtype it had, which FP8 products of it return. Rows round independently, so a batch rounded
    once can be split among many products (the experts of a MoE block) with the same results."""

    values: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def of(cls, x: torch.Tensor, scale_fmt: str | None) -> Rounded:
        return cls(act_round(x, scale_fmt), x.dtype)

    def __getitem__(self, index) -> Rounded:
        return Rounded(self.values[index], self.dtype)


def fp8_gemm_blockwise(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, scale_fmt: str | None, out_dtype: torch.dtype
) -> torch.Tensor:
    """The reference kernel's order: per 128-block partial products, scaled, summed in float32.

    Slow; kept as the definition the fast path is tested against.
    """
    q, s = act_quant(x, scale_fmt)
    *lead, k = x.shape
    n = weight.shape[0]
    a = q.float().reshape(-1, k // BLOCK, BLOCK)  # (M, K/128, 128)
    w = weight.float().reshape(n, k // BLOCK, BLOCK)  # (N, K/128, 128)
    partial = torch.einsum("mkb,nkb->kmn", a, w)  # (K/128, M, N)
    w_scale = scale.float().repeat_interleave(BLOCK, 0)[:n].t()  # (K/128, N)
    a_scale = s.reshape(-1, k // BLOCK).t()  # (K/128, M)
    out = torch.zeros(a.shape[0], n, dtype=torch.float32)
    for kb in range(k // BLOCK):
        out += partial[kb] * (a_scale[kb][:, None] * w_scale[kb][None, :])
    return out.to(out_dtype).reshape(*lead, n)


def fp8_index(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Index scores I[b, m, n] = k_scale[b, n] * sum_h weights[b, m, h] * relu(q[b, m, h] . k[b, n]).

    q: (B, M, H, D) fp8, weights: (B, M, H) float32 (head weight times q's scale), k: (B, N, D) fp8,
    k_scale: (B, N) float32. Queries go in chunks to bound the (M, N, H) float32 intermediate.
    """
    kf = k.float()
    out = []
    for start in range(0, q.shape[1], chunk):
        qf = q[:, start : start + chunk].float()
        logits = torch.einsum("bmhd,bnd->bmnh", qf, kf).relu_()  # (B, m, N, H)
        out.append((logits * weights[:, start : start + chunk, None, :]).sum(-1))  # (B, m, N)
    return torch.cat(out, dim=1) * k_scale[:, None, :]


@functools.lru_cache(maxsize=8)
def _hadamard(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)  # a constant per device: no host-to-device copy per call


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard rotation of the last dimension (Sylvester order), scaled by n**-0.5.

    As fast_hadamard_transform computes it: in float32, result in x's dtype.
    """
    n = x.shape[-1]
    h = _hadamard(n, str(x.device))
    return (torch.matmul(x.float(), h) * n**-0.5).to(x.dtype)
