"""FP8 e4m3 with 128-blocks, exactly as the reference's kernels round it; one module for all of it.

Shapes: M rows of activations, K input features, N output features, 128-wide blocks.

The reference's tilelang kernels (``act_quant``, ``fp8_gemm``, ``fp8_index``) are GPU-only; these are
plain PyTorch functions with the same rounding: activation scales are ``amax / 448`` (amax clamped
below at 1e-4), or the next power of two when ``scale_fmt`` is ``ue8m0``; values are divided by their
block's scale, clamped to +-448 and rounded to e4m3. A block-scaled product multiplies each 128-wide
partial dot product by both scales, accumulating in float32. When every scale is a power of two
(``ue8m0`` activations and power-of-two weight scales) the operands are dequantised first, which is
exact, and multiplied in bfloat16 on CUDA and on CPUs with bf16 units, in float32 on other CPUs
(:func:`model.ops.product_dtype`): the same products, summed in another order. Otherwise the
blocks are scaled and summed in the kernel's order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from . import ops

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# The kernel multiplies by 1/448 rounded to float32; dividing by 448 can differ in the last bit.
# (a Python float holding the float32 value: a float32 tensor times a Python scalar multiplies in float32)
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32).item()


def linear_dtype(checkpoint_dtype: str, weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the linear layers' weights: e4m3 for an ``fp8`` checkpoint, else ``weight_dtype``."""
    return FP8 if checkpoint_dtype == "fp8" else weight_dtype


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2**ceil(log2(x)) for positive float32 x, from the exponent bits as the kernel computes it:
    adding 2**23 - 1 to the bits carries into the exponent unless the mantissa is zero."""
    return ((x.view(torch.int32) + 0x7FFFFF) & -0x800000).view(torch.float32)  # -0x800000: 0xFF800000


@functools.lru_cache(maxsize=1)
def _fp8_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()  # (256,): every code's value


def to_float(t: torch.Tensor) -> torch.Tensor:
    """Float32 values of an FP8 tensor. On the CPU through a 256-entry table: torch converts FP8
    element by element there, about 6x slower than the lookup (same values: the table is torch's
    own conversion of every code)."""
    if t.dtype != FP8 or t.device.type != "cpu":
        return t.float()
    codes = t.reshape(-1).view(torch.uint8).int()
    return _fp8_table().index_select(0, codes).view(t.shape)


_BITS_FROM = 16384  # values from which _code_bits beats torch's conversion, counting its extra steps


def _code_bits(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The e4m3 codes' values times 2**-120, exactly, in ``dtype`` (bfloat16 or float32) on the CPU:
    the sign and the seven magnitude bits moved to where ``dtype``'s exponent field begins make a
    number 2**120 times smaller (a subnormal one for a subnormal code), 15x faster than torch's
    conversion. Codes must not be NaN (0x7f, 0xff)."""
    if dtype == torch.bfloat16:  # sign-extended code * 16, masked to 0x87F0: sign bit and 7 bits at the exponent
        return codes.view(torch.int8).to(torch.int16).mul_(16).bitwise_and_(-0x7810).view(torch.bfloat16)
    return codes.view(torch.int8).to(torch.int32).mul_(1 << 20).bitwise_and_(-0x78100000).view(torch.float32)


def _dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """Codes from :func:`act_quant` times their block's scale in ``dtype``: to_float(codes) * scale
    in float32, rounded to ``dtype``, bit for bit. ``pow2``: every scale is a power of two (then a
    bfloat16 result is formed in bfloat16: exact)."""
    *lead, k = codes.shape
    s = scale.unsqueeze(-1)  # (..., K/128, 1)
    form = dtype if pow2 and dtype in (torch.bfloat16, torch.float32) else torch.float32  # exact products
    if codes.device.type != "cpu" or codes.numel() < _BITS_FROM:  # few values: torch's conversion (exact)
        values = codes.to(form).reshape(*lead, k // BLOCK, BLOCK) * s.to(form)
    # act_quant makes a NaN code only in a block whose scale is not a positive finite number (NaN, inf,
    # or -0.0: ue8m0's rounding of NaN); below 2**8 a scale times 2**120 stays finite, and
    # multiplying the scaled-down values by it is one exact step
    elif dtype in (torch.bfloat16, torch.float32) and bool(((scale > 0) & (scale < 256)).all()):
        values = _code_bits(codes, form).reshape(*lead, k // BLOCK, BLOCK) * (s * 2.0**120).to(form)
    else:
        values = to_float(codes).reshape(*lead, k // BLOCK, BLOCK) * s
    return values.reshape(codes.shape).to(dtype)


def act_scale(amax: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """Per-block scale from the block's absolute maximum (float32)."""
    scale = amax.float().clamp(min=1e-4) * _FP8_MAX_INV
    return _pow2_ceil(scale) if scale_fmt else scale


def act_quant(x: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise the last dimension in blocks of 128: (fp8 values, float32 scale per block)."""
    *lead, k = x.shape
    if k % BLOCK:
        raise ValueError(f"act_quant: last dimension {k} is not a multiple of {BLOCK}")
    blocks = x.reshape(*lead, k // BLOCK, BLOCK)  # (..., K/128, 128): the maximum is exact in x's dtype
    scale = act_scale(blocks.abs().amax(dim=-1), scale_fmt)  # (..., K/128)
    y = torch.div(blocks, scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8)  # divided in float32
    return y.reshape(x.shape), scale


def act_dequant(y: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Float32 values of act_quant's output."""
    return _dequant(y, scale, torch.float32)


def fake_quant(x: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """x rounded through act_quant and back, in x's dtype (the reference's FP8 KV simulation)."""
    return _dequant(*act_quant(x, scale_fmt), x.dtype, bool(scale_fmt))


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """One scale per weight element from one per 128x128 block; edge blocks may be partial."""
    rows, cols = shape
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 weight [N, K] times its block scales [ceil(N/128), ceil(K/128)]."""
    check_scale_shape(weight.shape, scale.shape)
    return ops.threaded(weight.numel() * ops.VALUE_WORK, _weight_dequant, weight, scale, dtype)


def _weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (to_float(weight) * expand_scale(scale.float(), weight.shape)).to(dtype)


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


def is_pow2(scale: torch.Tensor) -> bool:
    """Every scale a power of two: FP8 codes times them are exact in float32 and in bfloat16
    (4 significant bits), so dequantising before the product rounds nothing."""
    return bool(torch.all(_pow2_ceil(scale.float().abs()) == scale))


def dequantise_first_is_exact(scale: torch.Tensor, scale_fmt: str | None) -> bool:
    """fp8_gemm's ``fast``: activation scales are powers of two (``ue8m0``) and so are the weight's."""
    return bool(scale_fmt) and is_pow2(scale)


@dataclass(frozen=True)
class Rounded:
    """An activation rounded through act_quant (FP8 codes and float32 scales per 128 values) and the
    dtype it had, which FP8 products of it return. Rows round independently, so a batch rounded
    once can be split among many products (the experts of a MoE block, the projections that read
    one input) with the same results; its values are made once per dtype they are asked in."""

    codes: torch.Tensor  # (..., K) float8_e4m3fn
    scale: torch.Tensor  # (..., K/128) float32
    dtype: torch.dtype
    pow2: bool = False  # every scale a power of two (ue8m0)
    made: dict = field(default_factory=dict, compare=False, repr=False)  # dtype -> values

    @classmethod
    def of(cls, x: torch.Tensor, scale_fmt: str | None) -> Rounded:
        return cls(*act_quant(x, scale_fmt), x.dtype, bool(scale_fmt))

    def values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rounded values in ``dtype``: float32's rounded to ``dtype`` (exact with ue8m0 scales)."""
        made = self.made.get(dtype)
        if made is None:
            made = self.made[dtype] = _dequant(self.codes, self.scale, dtype, self.pow2)
        return made

    def __getitem__(self, index) -> Rounded:
        return self._with(lambda t: t[index])

    def rows(self, index: torch.Tensor) -> Rounded:
        """These rows (index_select on the first dimension, faster than indexing)."""
        return self._with(lambda t: t.index_select(0, index))

    def _with(self, take) -> Rounded:
        return Rounded(take(self.codes), take(self.scale), self.dtype, self.pow2, {d: take(v) for d, v in self.made.items()})


def fp8_gemm(
    x: torch.Tensor | Rounded,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_fmt: str | None,
    fast: bool | None = None,
    cpu_weight: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """act_quant(x) times the block-scaled FP8 ``weight``, transposed, in x's dtype: the reference's
    ``fp8_gemm``.

    ``fast``: whether dequantising first is exact (``ue8m0`` activations and power-of-two weight
    scales); worked out from ``scale`` when not given. ``cpu_weight``: a copy of what the chosen
    path multiplies (the dequantised weight when fast, in the CPU's product dtype; the FP8 codes in
    float32 otherwise), kept by the caller because FP8 to float conversion is slow on CPUs;
    ``packed``: :func:`model.ops.pack` of it.
    """
    r = x if isinstance(x, Rounded) else Rounded.of(x, scale_fmt)
    if fast is None:
        fast = dequantise_first_is_exact(scale, scale_fmt)
    *lead, k = r.codes.shape
    if not fast:
        w = cpu_weight if cpu_weight is not None else to_float(weight)
        y = _blockwise(r.codes.reshape(-1, k), r.scale.reshape(-1, k // BLOCK), w, scale)
        return y.to(r.dtype).reshape(*lead, -1)
    if r.codes.is_cuda and r.dtype == torch.bfloat16:
        # both operands exact in bfloat16: cuBLAS multiplies exactly, accumulates in float32 and
        # rounds once to bfloat16, as the kernel's output
        return torch.matmul(r.values(torch.bfloat16), weight_dequant(weight, scale, torch.bfloat16).t())
    w = cpu_weight if cpu_weight is not None else weight_dequant(weight, scale, ops.product_dtype(r.dtype))
    return ops.linear(r.values(w.dtype), w, packed).to(r.dtype)  # values on the FP8 grid: exact in bfloat16 too


def _blockwise(codes: torch.Tensor, a_scale: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The kernel's order: each 128-wide block's float32 partial product times (activation scale x
    weight scale), added to the float32 sum block by block.

    codes (M, K) fp8, a_scale (M, K/128), w_codes (N, K) float32, w_scale (N/128, K/128).
    """
    m, k = codes.shape
    n = w_codes.shape[0]
    a = to_float(codes)
    b_scale = w_scale.repeat_interleave(BLOCK, 0)[:n]  # (N, K/128): each row's block scale
    out = torch.zeros(m, n, dtype=torch.float32, device=codes.device)
    for kb in range(k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        partial = ops.threaded(m * n * BLOCK, torch.matmul, a[:, cols], w_codes[:, cols].t())  # (M, N)
        out += partial * (a_scale[:, kb, None] * b_scale[None, :, kb])
    return out


def fp8_index(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    chunk: int | None = None,
    causal_from: int | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Index scores I[b, m, n] = k_scale[b, n] * sum_h weights[b, m, h] * relu(q[b, m, h] . k[b, n]).

    q: (B, M, H, D) fp8, weights: (B, M, H) float32 (head weight times q's scale), k: (B, N, D) fp8,
    k_scale: (B, N) float32. Queries go in chunks (default 256, 128 when skipping keys) to bound
    the (M, N, H) float32 intermediate.

    ``causal_from`` (a prefill's causal mask, on the CPU): query m sees keys up to causal_from + m
    only, and the keys after a chunk's last query are left at -inf rather than computed: what
    adding the mask makes of them, since every score is then finite (bounded here from the weights
    and scales; otherwise every score is computed, for the mask to add to). ``q_scale`` (q's
    act_quant scales), when given, tells whether a code of q is NaN without reading the codes.
    """
    wanted = causal_from is not None or max(q.numel(), k.numel()) >= _BITS_FROM  # what finite scores allow
    finite = q.device.type == "cpu" and wanted and _scores_finite(q, weights, k_scale, q_scale)
    kf = _codes_float(k, finite)
    n_keys = kf.shape[1]
    skip = finite and causal_from is not None
    chunk = chunk or (128 if skip else 256)
    out = torch.full((q.shape[0], q.shape[1], n_keys), float("-inf"), device=q.device)  # (B, M, N)
    for start in range(0, q.shape[1], chunk):
        stop = min(start + chunk, q.shape[1])
        n = min(n_keys, causal_from + stop) if skip else n_keys  # the keys this chunk's queries see
        qf = _codes_float(q[:, start:stop], finite)
        keys, work = kf[:, :n], qf.numel() * n
        logits = ops.threaded(work, torch.einsum, "bmhd,bnd->bmnh", qf, keys).relu_()  # (B, m, n, H)
        out[:, start:stop, :n] = logits.mul_(weights[:, start:stop, None, :]).sum(-1)
    return out.mul_(k_scale[:, None, :])


def _scores_finite(q: torch.Tensor, weights: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor | None) -> bool:
    """No code NaN and every index score finite. act_quant makes a NaN code only in a block whose
    scale is not a positive finite number (q's codes are read when its scales are not given); then
    |q . k| <= 128 * 448**2 bounds every score by the head weights' absolute sums (q's scales are in
    them) and the key scales: a NaN or infinite weight or scale fails the bound."""
    if not bool((k_scale > 0).all()):
        return False
    if q_scale is not None and not bool((q_scale > 0).all()) or q_scale is None and _has_nan(q):
        return False
    bound = float(weights.abs().sum(-1).amax()) * (128 * FP8_MAX**2)
    return bound < 1e37 and bound * max(1.0, float(k_scale.amax())) < 1e37


def _has_nan(codes: torch.Tensor) -> bool:
    """Whether any FP8 code is NaN (0x7f or 0xff)."""
    return bool(((codes.view(torch.uint8) | 0x80) == 0xFF).any())


def _codes_float(codes: torch.Tensor, finite: bool) -> torch.Tensor:
    """Float32 values of act_quant's codes; through their bits where there are many and none can be
    NaN (every scale is finite)."""
    if codes.numel() < _BITS_FROM:
        return codes.float()
    return _code_bits(codes, torch.float32).mul_(2.0**120) if finite else to_float(codes)


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
    return ops.threaded(x.numel() * n, torch.matmul, x.float(), h).mul_(n**-0.5).to(x.dtype)
