"""FP8 e4m3 with 128-blocks, exactly as the reference's kernels round it, in plain PyTorch.

Shapes: M rows of activations, K input features, N output features, 128-wide blocks.

The reference's tilelang kernels (``act_quant``, ``fp8_gemm``, ``fp8_index``) are GPU-only; these are
plain PyTorch functions with the same rounding: activation scales are ``amax / 448`` (amax clamped
below at 1e-4), or the next power of two when ``scale_fmt`` is ``ue8m0``; values are divided by their
block's scale, clamped to +-448 and rounded to e4m3. A block-scaled product forms each 128-wide
partial dot product of the codes in float32, multiplies it by both scales and adds it to a float32
sum, block after block, as the reference's ``fp8_gemm`` kernel does, whatever the scales.

Summing the whole K at once instead is faster but groups the float32 sum otherwise: even with
power-of-two scales, where dequantising first is exact, about 1 in 4,000 bfloat16 outputs moves
by one unit, and the next FP8 rounding of the activations amplifies it into other selections at
the real width. That grouping is taken only inside :func:`inexact_sums`.

The CPU backend (model.kernels) has faster routes to the same values; the model reaches these
functions through it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

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


def dequant(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes from :func:`act_quant` times their block's scale: in float32, rounded to ``dtype``."""
    *lead, k = codes.shape
    values = codes.float().reshape(*lead, k // BLOCK, BLOCK) * scale.unsqueeze(-1)  # (..., K/128, 128)
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


# False inside unrounded_activations: per thread (and per context), so a model shared by several
# threads rounds in every pass but the ones that asked it not to
_ROUND_ACTIVATIONS: contextvars.ContextVar[bool] = contextvars.ContextVar("round_activations", default=True)


def rounds_activations() -> bool:
    """Whether FP8 products round their input activations, as the reference always does."""
    return _ROUND_ACTIVATIONS.get()


@contextlib.contextmanager
def unrounded_activations():
    """The forward passes this thread runs here take their activations unrounded, as a reference
    that does not quantise them would (DeepSeek-V3's ``gemm_impl="bf16"``: ``weight_dequant``, then
    ``F.linear``): FP8 products multiply x by the weight dequantised to x's dtype, the indexer's q
    and k stay in the activation dtype, the MLA latent skips its FP8 simulation. The weights are
    the same FP8 codes times their scales; only the activations' rounding is gone."""
    token = _ROUND_ACTIVATIONS.set(False)
    try:
        yield
    finally:
        _ROUND_ACTIVATIONS.reset(token)


def quantised(x: torch.Tensor, scale_fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """act_quant(x) (the indexer's FP8 q and k), or x itself with unit scales (..., 1) where
    activations are not rounded (:func:`unrounded_activations`)."""
    if rounds_activations():
        return act_quant(x, scale_fmt)
    return x, torch.ones(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)


def fake_quant(x: torch.Tensor, scale_fmt: str | None = None) -> torch.Tensor:
    """x rounded through act_quant and back, in x's dtype (the reference's FP8 KV simulation)."""
    return dequant(*act_quant(x, scale_fmt), x.dtype)


def expand_scale(scale: torch.Tensor, shape: torch.Size | tuple[int, int]) -> torch.Tensor:
    """One scale per weight element from one per 128x128 block; edge blocks may be partial."""
    rows, cols = shape
    return scale.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]


def weight_dequant(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 weight [N, K] times its block scales [ceil(N/128), ceil(K/128)], in float32, rounded to ``dtype``."""
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


def is_pow2(scale: torch.Tensor) -> bool:
    """Every scale a power of two: FP8 codes times them are exact in float32 and in bfloat16
    (4 significant bits), so a dequantised weight rounds nothing."""
    return bool(torch.all(_pow2_ceil(scale.float().abs()) == scale))


# True inside straight_through: per thread (and per context), as _ROUND_ACTIVATIONS
_STRAIGHT_THROUGH: contextvars.ContextVar[bool] = contextvars.ContextVar("straight_through", default=False)


def passes_straight_through() -> bool:
    """Whether this thread's passes carry gradients past the FP8 roundings (:func:`straight_through`)."""
    return _STRAIGHT_THROUGH.get()


@contextlib.contextmanager
def straight_through():
    """Forward passes here compute the same values, bit for bit, and a backward through them treats
    every FP8 rounding of an activation as the identity (the straight-through estimator): a product
    of rounded x passes its gradient to x unrounded, the MLA latent's FP8 simulation passes it
    unchanged. Selections (the indexer's keys, the router's experts) carry none: they are integers,
    and the indexer's scores serve only to choose. model.kernels applies it, only where autograd
    records (``torch.is_grad_enabled()`` and an input that requires grad)."""
    token = _STRAIGHT_THROUGH.set(True)
    try:
        yield
    finally:
        _STRAIGHT_THROUGH.reset(token)


# True inside inexact_sums: per thread (and per context), as _ROUND_ACTIVATIONS
_WHOLE_K: contextvars.ContextVar[bool] = contextvars.ContextVar("inexact_sums", default=False)
INEXACT_SUMS = "whole K in the activations' dtype, not the kernel's per-block float32 order"


def sums_inexactly() -> bool:
    """Whether FP8 products sum the whole K at once (:func:`inexact_sums`)."""
    return _WHOLE_K.get()


@contextlib.contextmanager
def inexact_sums():
    """FP8 products in this context dequantise both operands and multiply them over the whole K in
    the activations' dtype (one float32 sum, rounded once): faster, and what a plain
    ``F.linear`` of the dequantised weight gives, but not the kernel's grouping of the sum, so
    outputs move by a bfloat16 unit here and there and selections downstream can change. Traces
    made inside it say so (``fp8_sums`` in their metadata)."""
    token = _WHOLE_K.set(True)
    try:
        yield
    finally:
        _WHOLE_K.reset(token)


@dataclass(frozen=True)
class Rounded:
    """An activation rounded through act_quant (FP8 codes and float32 scales per 128 values) and the
    dtype it had, which FP8 products of it return. Rows round independently, so a batch rounded
    once can be split among many products (the experts of a MoE block, the projections that read
    one input) with the same results; its values are made once per dtype they are asked in."""

    codes: torch.Tensor  # (..., K) float8_e4m3fn
    scale: torch.Tensor  # (..., K/128) float32
    dtype: torch.dtype
    pow2: bool = False  # every scale a power of two (ue8m0): the values are exact in bfloat16 too
    made: dict = field(default_factory=dict, compare=False, repr=False)  # dtype -> values
    # inside straight_through: the unrounded x, whose gradient the products of these values pass on
    source: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, x: torch.Tensor, scale_fmt: str | None) -> Rounded:
        source = x if passes_straight_through() and x.requires_grad else None
        return cls(*act_quant(x.detach(), scale_fmt), x.dtype, bool(scale_fmt), source=source)

    def values(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rounded values in ``dtype``: float32's rounded to ``dtype`` (exact with ue8m0 scales)."""
        made = self.made.get(dtype)
        if made is None:
            made = self.made[dtype] = dequant(self.codes, self.scale, dtype)
        return made

    def __getitem__(self, index) -> Rounded:
        return self._with(lambda t: t[index])

    def flat(self) -> Rounded:
        """The rows as a matrix: codes (M, K), scales (M, K/128)."""
        return self._with(lambda t: t.reshape(-1, t.shape[-1]))

    def rows(self, index: torch.Tensor) -> Rounded:
        """These rows (index_select on the first dimension, faster than indexing)."""
        return self._with(lambda t: t.index_select(0, index))

    def _with(self, take) -> Rounded:
        made = {d: take(v) for d, v in self.made.items()}
        source = None if self.source is None else take(self.source)
        return Rounded(take(self.codes), take(self.scale), self.dtype, self.pow2, made, source)


def rounded(x: torch.Tensor, scale_fmt: str | None) -> torch.Tensor | Rounded:
    """x as FP8 products read it: rounded (:class:`Rounded`, to share among the products of one
    input), or x itself where activations are not rounded (:func:`unrounded_activations`)."""
    return Rounded.of(x, scale_fmt) if rounds_activations() else x


def unrounded_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x times the FP8 ``weight`` dequantised to x's dtype, x unrounded: the product of a reference
    that does not quantise its activations (:func:`unrounded_activations`)."""
    form = x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.float32
    return F.linear(x.to(form), weight_dequant(weight, scale, x.dtype).to(form)).to(x.dtype)


def fp8_gemm(x: torch.Tensor | Rounded, weight: torch.Tensor, scale: torch.Tensor, scale_fmt: str | None) -> torch.Tensor:
    """act_quant(x) times the block-scaled FP8 ``weight``, transposed, in x's dtype: the reference's
    ``fp8_gemm``, each 128-wide block's partial product scaled and summed in the kernel's order
    (:func:`blockwise`). ``x`` may come rounded already (:class:`Rounded`, shared by several
    products). Inside :func:`inexact_sums` the dequantised operands are multiplied over the whole K."""
    r = x if isinstance(x, Rounded) else Rounded.of(x, scale_fmt)
    *lead, k = r.codes.shape
    if sums_inexactly():
        form = r.dtype if r.dtype in (torch.bfloat16, torch.float32) else torch.float32
        return F.linear(r.values(form), weight_dequant(weight, scale, form)).to(r.dtype)
    y = blockwise(r.codes.reshape(-1, k), r.scale.reshape(-1, k // BLOCK), weight.float(), scale)
    return y.to(r.dtype).reshape(*lead, -1)


def blockwise(
    codes: torch.Tensor,
    a_scale: torch.Tensor | None,
    w_codes: torch.Tensor,
    w_scale: torch.Tensor | None,
    product=None,
) -> torch.Tensor:
    """The kernel's order: each 128-wide block's float32 partial product (:func:`block_product`)
    times (activation scale x weight scale), added to the float32 sum block by block. ``product``
    forms the partial products (default :func:`block_product`; the CPU route threads it). Scales
    None: the operands are their dequantised float32 values already, whose partial products are the
    scaled ones exactly where every scale is a power of two (kernels.fp8.kernel_order).

    codes (M, K) fp8, a_scale (M, K/128), w_codes (N, K) float32, w_scale (N/128, K/128).
    """
    m, k = codes.shape
    n = w_codes.shape[0]
    a = padded_rows(codes.float())
    product = product or block_product
    b_scale = None if w_scale is None else w_scale.repeat_interleave(BLOCK, 0)[:n]  # (N, K/128): each row's block scale
    out = torch.zeros(m, n, dtype=torch.float32, device=codes.device)
    # on the meta device (where tracing.plan counts a run) no value is formed and every block
    # allocates what the first does: one block stands for all
    for kb in range(1 if codes.is_meta else k // BLOCK):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        partial = product(a[:, cols], w_codes[:, cols])[:m]  # (M, N)
        out += partial if b_scale is None else partial * (a_scale[:, kb, None] * b_scale[None, :, kb])
    return out


# On the CPU a float32 product of at least this many rows sums each 128-term dot product in order
# (one product after another); with fewer rows the BLAS may take other paths (on a 2-core EPYC:
# other orders below 4 rows, and for 5-11 rows on two threads), so a row's value would depend on
# how many rows share its product and on the thread count. The kernel's rows are independent.
IN_ORDER_ROWS = 16


def padded_rows(a: torch.Tensor) -> torch.Tensor:
    """``a`` (M, K) with zero rows added up to IN_ORDER_ROWS on the CPU (the values of the first M
    rows of a product are then summed in order); as it is elsewhere."""
    if a.device.type != "cpu" or a.shape[0] >= IN_ORDER_ROWS:
        return a
    return torch.cat([a, a.new_zeros(IN_ORDER_ROWS - a.shape[0], a.shape[1])])


def block_product(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(M, 128) x (N, 128) -> (M, N) in float32, each output the sum of its 128 products (exact:
    e4m3 times e4m3 fits float32) added one after another, as one dot product of the kernel's
    block. On the CPU that is the BLAS's product where it sums in that order (checked once:
    :func:`blas_sums_in_order`; ``a`` padded by :func:`padded_rows`), else formed term by term;
    on a GPU the BLAS's product as it forms it."""
    if a.device.type != "cpu" or blas_sums_in_order():
        return torch.matmul(a, w.t())
    return in_order(a, w)


def in_order(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The in-order sum of :func:`block_product`, term by term (slow: one pass over (M, N) per term)."""
    out = torch.zeros(a.shape[0], w.shape[0], dtype=torch.float32, device=a.device)
    for j in range(a.shape[1]):
        out += a[:, j, None] * w[None, :, j]  # each product exact in float32, then one rounding of the sum
    return out


def blas_sums_in_order() -> bool:
    """Whether this CPU's float32 BLAS product of IN_ORDER_ROWS or more rows and 128-wide blocks
    sums each dot product in order, at the calling thread's thread count: tried once per count."""
    return _sums_in_order(torch.get_num_threads())


@functools.lru_cache(maxsize=16)
def _sums_in_order(threads: int) -> bool:
    """The check of :func:`blas_sums_in_order` (``threads``: the count it holds for), on e4m3 values
    whose float32 sums round (every finite code, subnormals among them), against :func:`in_order`."""
    gen = torch.Generator().manual_seed(0)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    codes = codes[~codes.isnan()]
    for rows, n in ((IN_ORDER_ROWS, 256), (IN_ORDER_ROWS + 1, 128), (33, 576)):
        a = codes[torch.randint(0, len(codes), (rows, BLOCK), generator=gen)]
        w = codes[torch.randint(0, len(codes), (n, BLOCK), generator=gen)]
        if not torch.equal(torch.matmul(a, w.t()), in_order(a, w)):
            return False
    return True


INDEX_CHUNK = 256  # queries per step of fp8_index: bounds its (M, N, H) float32 intermediate


def fp8_index(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """Index scores I[b, m, n] = k_scale[b, n] * sum_h weights[b, m, h] * relu(q[b, m, h] . k[b, n]).

    q: (B, M, H, D) fp8, weights: (B, M, H) float32 (head weight times q's scale), k: (B, N, D) fp8,
    k_scale: (B, N) float32; products in float32. Queries go in chunks of INDEX_CHUNK."""
    kf = k.float()
    out = torch.empty(q.shape[0], q.shape[1], kf.shape[1], device=q.device)  # (B, M, N)
    for start in range(0, q.shape[1], INDEX_CHUNK):
        stop = min(start + INDEX_CHUNK, q.shape[1])
        logits = torch.einsum("bmhd,bnd->bmnh", q[:, start:stop].float(), kf).relu_()  # (B, m, N, H)
        out[:, start:stop] = logits.mul_(weights[:, start:stop, None, :]).sum(-1)
    return out.mul_(k_scale[:, None, :])


@functools.lru_cache(maxsize=8)
def hadamard_matrix(n: int, device: torch.device | str) -> torch.Tensor:
    """The n x n Walsh-Hadamard matrix in Sylvester order (a constant per device)."""
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h.to(device)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard rotation of the last dimension (Sylvester order), scaled by n**-0.5.

    As fast_hadamard_transform computes it: in float32, result in x's dtype.
    """
    n = x.shape[-1]
    return torch.matmul(x.float(), hadamard_matrix(n, x.device)).mul_(n**-0.5).to(x.dtype)
