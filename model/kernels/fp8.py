"""The CPU's faster routes to model.fp8's values: FP8 codes decoded from their bits or a table, weights
dequantised once and kept, the indexer's masked keys left uncomputed, the products threaded.

Each function gives the plain function's values (model.fp8): tests/model/test_kernels.py checks it.
"""

from __future__ import annotations

import functools

import torch

from .. import fp8
from ..fp8 import BLOCK, FP8, FP8_MAX, Rounded
from . import products, weights
from .threads import VALUE_WORK, threaded

_BITS_FROM = 16384  # values from which code_bits beats torch's conversion, counting its extra steps


@functools.lru_cache(maxsize=1)
def _fp8_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()  # (256,): every code's value


def to_float(t: torch.Tensor) -> torch.Tensor:
    """Float32 values of an FP8 tensor through a 256-entry table: torch converts FP8 element by
    element on the CPU, about 6x slower than the lookup (same values: the table is torch's own
    conversion of every code)."""
    if t.dtype != FP8:
        return t.float()
    codes = t.reshape(-1).view(torch.uint8).int()
    return _fp8_table().index_select(0, codes).view(t.shape)


def code_bits(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The e4m3 codes' values times 2**-120, exactly, in ``dtype`` (bfloat16 or float32): the sign
    and the seven magnitude bits moved to where ``dtype``'s exponent field begins make a number
    2**120 times smaller (a subnormal one for a subnormal code), 15x faster than torch's
    conversion. Codes must not be NaN (0x7f, 0xff)."""
    if dtype == torch.bfloat16:  # sign-extended code * 16, masked to 0x87F0: sign bit and 7 bits at the exponent
        return codes.view(torch.int8).to(torch.int16).mul_(16).bitwise_and_(-0x7810).view(torch.bfloat16)
    return codes.view(torch.int8).to(torch.int32).mul_(1 << 20).bitwise_and_(-0x78100000).view(torch.float32)


def converted(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """:func:`dequant` through torch's own conversion of the codes, on any device and with no read
    back to the host (the GPU's route, and few values here)."""
    *lead, k = codes.shape
    form = dtype if pow2 and dtype in (torch.bfloat16, torch.float32) else torch.float32  # exact products
    values = codes.to(form).reshape(*lead, k // BLOCK, BLOCK) * scale.unsqueeze(-1).to(form)  # (..., K/128, 128)
    return values.reshape(codes.shape).to(dtype)


def dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, pow2: bool = False) -> torch.Tensor:
    """model.fp8.dequant, bit for bit: to_float(codes) * scale in float32, rounded to ``dtype``.
    ``pow2``: every scale is a power of two (then a bfloat16 result is formed in bfloat16: exact)."""
    if codes.numel() < _BITS_FROM:  # few values: torch's conversion (exact)
        return converted(codes, scale, dtype, pow2)
    *lead, k = codes.shape
    s = scale.unsqueeze(-1)  # (..., K/128, 1)
    form = dtype if pow2 and dtype in (torch.bfloat16, torch.float32) else torch.float32  # exact products
    # act_quant makes a NaN code only in a block whose scale is not a positive finite number (NaN, inf,
    # or -0.0: ue8m0's rounding of NaN); below 2**8 a scale times 2**120 stays finite, and
    # multiplying the scaled-down values by it is one exact step
    if dtype in (torch.bfloat16, torch.float32) and bool(((scale > 0) & (scale < 256)).all()):
        values = code_bits(codes, form).reshape(*lead, k // BLOCK, BLOCK) * (s * 2.0**120).to(form)
    else:
        values = to_float(codes).reshape(*lead, k // BLOCK, BLOCK) * s
    return values.reshape(codes.shape).to(dtype)


def values(r: Rounded, dtype: torch.dtype, decode=dequant) -> torch.Tensor:
    """Rounded.values, decoded by ``decode`` (:func:`dequant`, or :func:`converted`: the same values);
    made once per dtype."""
    made = r.made.get(dtype)
    if made is None:
        made = r.made[dtype] = decode(r.codes, r.scale, dtype, r.pow2)
    return made


def fake_quant(x: torch.Tensor, scale_fmt: str | None, decode=dequant) -> torch.Tensor:
    """model.fp8.fake_quant, decoded by ``decode`` (as :func:`values`)."""
    return decode(*fp8.act_quant(x, scale_fmt), x.dtype, bool(scale_fmt))


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """model.fp8.weight_dequant, threaded by the values it writes."""
    fp8.check_scale_shape(weight.shape, scale.shape)
    return threaded(weight.numel() * VALUE_WORK, _weight_dequant, weight, scale, dtype)


def _weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (to_float(weight) * fp8.expand_scale(scale.float(), weight.shape)).to(dtype)


def exactly_dequantised(scale: torch.Tensor) -> bool:
    """fp8.is_pow2 of a weight's scales, worked out once per scale tensor (a CPU weight's: no
    device synchronisation)."""
    return weights.kept(scale, ("pow2",), lambda: fp8.is_pow2(scale))


def dequantized(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight_dequant(weight, scale, dtype), kept with the weight."""
    return weights.kept(weight, ("dequantized", dtype), lambda: weight_dequant(weight, scale, dtype), (scale,))


def packed(weight: torch.Tensor, copy: torch.Tensor, key) -> torch.Tensor | None:
    """products.pack of ``copy`` (a bfloat16 form of ``weight``), kept with the weight; None for a
    weight used once (laying it out would cost what it saves)."""
    if copy.dtype != torch.bfloat16 or not weights.keeps(weight) or not products.packed_products_agree():
        return None
    return weights.kept(weight, ("packed", key), lambda: products.pack(copy))


def fp8_gemm(x: torch.Tensor | Rounded, weight: torch.Tensor, scale: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """model.fp8.fp8_gemm: the kernel's block order over the FP8 codes, the weight's decoded once
    and kept; inside model.fp8.inexact_sums, the activations' values times the weight dequantised
    once in the CPU's product dtype (and laid out for oneDNN)."""
    r = x if isinstance(x, Rounded) else Rounded.of(x, scale_fmt)
    *lead, k = r.codes.shape
    if not fp8.sums_inexactly():
        return kernel_order(r.flat(), weight, scale).to(r.dtype).reshape(*lead, -1)
    compute = products.product_dtype(r.dtype)
    w = dequantized(weight, scale, compute)
    return products.linear(values(r, compute), w, packed(weight, w, compute)).to(r.dtype)  # values on the FP8 grid


def kernel_order(r: Rounded, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """model.fp8.blockwise of rounded rows ``r`` (M, K) and an FP8 weight: (M, N) float32.

    Where every scale is a power of two (UE8M0 activations, as ``r.pow2`` says, and weight scales
    found so once per weight) a block's partial product times both scales is the partial product
    of the dequantised operands, exactly: each term is scaled by the same power of two, and so is
    each rounding of the in-order sum (no value here comes near float32's range ends). So the
    blocks multiply the rows' float32 values and the weight dequantised once and kept, and no
    pass applies scales. Otherwise the codes' products are scaled as the kernel scales them."""
    if r.pow2 and exactly_dequantised(scale):
        return blockwise(values(r, torch.float32), None, dequantized(weight, scale, torch.float32), None)
    k = r.codes.shape[-1]
    return blockwise(r.codes, r.scale.reshape(-1, k // BLOCK), float_codes(weight), scale)


def float_codes(weight: torch.Tensor) -> torch.Tensor:
    """The FP8 weight's codes as float32 values (N, K), kept with the weight: what the blockwise
    products multiply."""
    return weights.kept(weight, ("codes",), lambda: to_float(weight))


def unrounded_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """model.fp8.unrounded_gemm: x times the weight dequantised to x's dtype (kept), in the CPU's
    product dtype. With power-of-two weight scales that dequantised weight is exact, so the normal
    products' copy serves (the same values widened)."""
    compute = products.product_dtype(x.dtype)
    if exactly_dequantised(scale):
        w = dequantized(weight, scale, compute)
    else:  # rounded to x's dtype first, as the reference's weight_dequant; widening it is exact
        w = dequantized(weight, scale, x.dtype)
        w = w if w.dtype == compute else weights.kept(weight, ("unrounded", compute), lambda: w.to(compute))
    return products.linear(x.to(compute), w, packed(weight, w, compute)).to(x.dtype)


def blockwise(
    codes: torch.Tensor, a_scale: torch.Tensor | None, w_codes: torch.Tensor, w_scale: torch.Tensor | None
) -> torch.Tensor:
    """model.fp8.blockwise, each block's product threaded, FP8 codes decoded by table."""
    m, n = codes.shape[0], w_codes.shape[0]

    def product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # rows padded: at least IN_ORDER_ROWS
        return threaded(max(m, fp8.IN_ORDER_ROWS) * n * BLOCK, fp8.block_product, a, w)

    return fp8.blockwise(to_float(codes), a_scale, w_codes, w_scale, product)


def fp8_index(
    q: torch.Tensor,
    weights_: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    causal_from: int | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """model.fp8.fp8_index. ``causal_from`` (a prefill's causal mask): query m sees keys up to
    causal_from + m only, and the keys after a chunk's last query are left at -inf rather than
    computed: what adding the mask makes of them, since every score is then finite (bounded here
    from the weights and scales; otherwise every score is computed, for the mask to add to).
    ``q_scale`` (q's act_quant scales) tells whether a code of q is NaN without reading the codes."""
    wanted = causal_from is not None or max(q.numel(), k.numel()) >= _BITS_FROM  # what finite scores allow
    finite = wanted and _scores_finite(q, weights_, k_scale, q_scale)
    kf = _codes_float(k, finite)
    n_keys = kf.shape[1]
    skip = finite and causal_from is not None
    chunk = 128 if skip else fp8.INDEX_CHUNK
    out = torch.full((q.shape[0], q.shape[1], n_keys), float("-inf"), device=q.device)  # (B, M, N)
    for start in range(0, q.shape[1], chunk):
        stop = min(start + chunk, q.shape[1])
        n = min(n_keys, causal_from + stop) if skip else n_keys  # the keys this chunk's queries see
        qf = _codes_float(q[:, start:stop], finite)
        logits = threaded(qf.numel() * n, torch.einsum, "bmhd,bnd->bmnh", qf, kf[:, :n]).relu_()  # (B, m, n, H)
        out[:, start:stop, :n] = logits.mul_(weights_[:, start:stop, None, :]).sum(-1)
    return out.mul_(k_scale[:, None, :])


def _scores_finite(q: torch.Tensor, weights_: torch.Tensor, k_scale: torch.Tensor, q_scale: torch.Tensor | None) -> bool:
    """No code NaN and every index score finite. act_quant makes a NaN code only in a block whose
    scale is not a positive finite number (q's codes are read when its scales are not given); then
    |q . k| <= 128 * 448**2 bounds every score by the head weights' absolute sums (q's scales are in
    them) and the key scales: a NaN or infinite weight or scale fails the bound."""
    if not bool((k_scale > 0).all()):
        return False
    if q_scale is not None and not bool((q_scale > 0).all()) or q_scale is None and _has_nan(q):
        return False
    bound = float(weights_.abs().sum(-1).amax()) * (128 * FP8_MAX**2)
    return bound < 1e37 and bound * max(1.0, float(k_scale.amax())) < 1e37


def _has_nan(codes: torch.Tensor) -> bool:
    """Whether any FP8 code is NaN (0x7f or 0xff)."""
    return bool(((codes.view(torch.uint8) | 0x80) == 0xFF).any())


def _codes_float(codes: torch.Tensor, finite: bool) -> torch.Tensor:
    """Float32 values of act_quant's codes; through their bits where there are many and none can be
    NaN (every scale is finite)."""
    if codes.numel() < _BITS_FROM:
        return codes.float()
    return code_bits(codes, torch.float32).mul_(2.0**120) if finite else to_float(codes)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """model.fp8.hadamard, threaded."""
    n = x.shape[-1]
    h = fp8.hadamard_matrix(n, x.device)
    return threaded(x.numel() * n, torch.matmul, x.float(), h).mul_(n**-0.5).to(x.dtype)
