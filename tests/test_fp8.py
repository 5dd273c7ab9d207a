import pytest
import torch

from model import fp8
from model.linear import Linear


def test_act_quant_error_within_e4m3_bounds():
    torch.manual_seed(213)  # a seed where a subnormal rounds by nearly half a step
    x = torch.randn(64, 512) * torch.logspace(-3, 2, 512)
    q, s = fp8.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4)
    back = fp8.act_dequant(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale below
    bound = torch.maximum(x.abs() * 2**-4, s.repeat_interleave(128, dim=-1) * 2**-10)  # each row's own scales
    assert torch.all((back - x).abs() <= bound)


def test_ue8m0_scales_are_powers_of_two_and_cover_the_block():
    x = torch.randn(8, 256) * 37.0
    q, s = fp8.act_quant(x, "ue8m0")
    assert torch.equal(s, 2.0 ** torch.log2(s).round())
    amax = x.abs().view(8, 2, 128).amax(-1)
    assert torch.all(amax / s <= 448) and torch.all(amax / s > 224)


def test_scale_is_amax_over_448_rounded_like_the_kernel():
    x = torch.zeros(1, 128)
    x[0, 5] = 3.0
    _, s = fp8.act_quant(x)
    assert s.item() == (torch.tensor(3.0) * torch.tensor(1 / 448, dtype=torch.float32)).item()
    _, s = fp8.act_quant(torch.zeros(1, 128))  # amax clamps at 1e-4
    assert s.item() == pytest.approx(1e-4 / 448)


def test_weight_blocks_are_128_with_partial_edges():
    w = torch.randn(576, 7168 // 28) * 0.02  # kv_a_proj_with_mqa has 576 rows: 5 row blocks, the last of 64
    q, s = fp8.weight_quant(w)
    assert s.shape == (5, 2)
    back = fp8.weight_dequant(q, s)
    assert torch.allclose(back, w, rtol=2**-4, atol=float(s.max()) * 2**-9)
    with pytest.raises(ValueError, match="scale shape"):
        fp8.weight_dequant(q, s[:4])  # 576 / 128 would be wrong


def kernel_order_gemm(x, w, s, fmt):
    """The tilelang fp8_gemm's arithmetic: per 128-block float32 partial products of the FP8 codes,
    each times (activation scale * weight scale), summed block by block in float32."""
    q, qs = fp8.act_quant(x, fmt)
    n, k = w.shape
    partial = torch.einsum("mkb,nkb->kmn", q.float().reshape(-1, k // 128, 128), w.float().reshape(n, k // 128, 128))
    w_scale = s.repeat_interleave(128, 0)[:n].t()  # (K/128, N)
    out = torch.zeros(q.shape[0], n)
    for kb in range(k // 128):
        out += partial[kb] * (qs[:, kb, None] * w_scale[kb][None, :])
    return out


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("pow2_weight_scales", [True, False])
def test_gemm_equals_the_kernel_order(fmt, pow2_weight_scales):
    """Bit for bit where it matters: with power-of-two scales everywhere the dequantise-first path
    is exact; otherwise (amax / 448 activation or weight scales) the blocks are summed as the kernel
    sums them, since rounding code x scale first moves outputs by an ulp and can flip a selection."""
    torch.manual_seed(0)
    x = torch.randn(7, 384, dtype=torch.bfloat16)
    w, s = fp8.weight_quant(torch.randn(200, 384) * 0.05, "ue8m0" if pow2_weight_scales else None)
    assert fp8.is_pow2(s) == pow2_weight_scales
    got = fp8.fp8_gemm(x, w, s, fmt)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kernel_order_gemm(x, w, s, fmt).to(torch.bfloat16))
    lin = Linear(384, 200, fp8.FP8, scale_fmt=fmt)
    lin.weight.data, lin.scale.data = w, s
    for _ in range(2):  # the float32 copy made on first use multiplies the same way
        assert torch.equal(lin(x), got)
    rounded = fp8.Rounded.of(x, fmt)
    assert torch.equal(lin(rounded[2:5]), got[2:5])  # rows rounded once, products on a selection
    want = fp8.weight_dequant(w, s, torch.bfloat16)
    assert torch.equal(lin.dequantized(torch.bfloat16), want)
    lin.cache_dequantized = False  # as on a GPU or while streaming: no float32 copy kept
    assert torch.equal(lin(x), got) and torch.equal(lin.dequantized(torch.bfloat16), want)


def test_dequantise_first_is_not_the_kernel_order_for_other_scales():
    """Why the slow path exists: float32 products of dequantised operands differ from the kernel's."""
    torch.manual_seed(1)
    x = torch.randn(64, 1024)
    w, s = fp8.weight_quant(torch.randn(256, 1024) * 0.05, None)
    first = fp8.act_dequant(*fp8.act_quant(x, None)) @ fp8.weight_dequant(w, s).t()
    assert not torch.equal(first, kernel_order_gemm(x, w, s, None))


def test_fp8_index_is_relu_weighted_sum_over_heads():
    torch.manual_seed(0)
    q, qs = fp8.act_quant(torch.randn(1, 3, 4, 128))
    k, ks = fp8.act_quant(torch.randn(1, 5, 128))
    w = torch.randn(1, 3, 4)
    got = fp8.fp8_index(q, w, k, ks.squeeze(-1))
    want = torch.zeros(1, 3, 5)
    for t in range(3):
        for s_ in range(5):
            for h in range(4):
                want[0, t, s_] += w[0, t, h] * torch.relu(q[0, t, h].float() @ k[0, s_].float())
            want[0, t, s_] *= ks[0, s_, 0]
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_hadamard_is_orthonormal_in_sylvester_order():
    x = torch.eye(8)
    h = fp8.hadamard(x) * 8**0.5
    assert torch.allclose(h[1], torch.tensor([1.0, -1, 1, -1, 1, -1, 1, -1]))
    y = torch.randn(3, 128)
    assert torch.allclose(fp8.hadamard(fp8.hadamard(y)), y, atol=1e-5)


def test_fp8_to_float_is_torchs_conversion_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).reshape(4, 64)
    for t in (codes, codes[:, ::3]):  # contiguous and strided
        got, want = fp8.to_float(t), t.float()
        assert got.shape == want.shape and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
        assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert int(torch.isnan(fp8.to_float(codes)).sum()) == 2  # 0x7f and 0xff


def _every_code_in_blocks(dtype: torch.dtype, scales: torch.Tensor) -> torch.Tensor:
    """Rows of 128 values that round to every finite e4m3 code, each row times its own scale, in
    ``dtype``; a few rows carry an exact zero, -0.0, and values below the subnormal step."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).float()
    values = values[~values.isnan()]  # 254 codes
    rows = values.repeat(2)[: 2 * 128].view(2, 128).repeat(len(scales) // 2, 1)  # every code in each row pair
    rows[0, :3] = torch.tensor([0.0, -0.0, 2.0**-12])
    return (rows * scales[:, None]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("rows", [4, 256], ids=["few values", "many values"])
def test_rounded_values_are_the_dequantised_codes_bit_for_bit(dtype, fmt, rows):
    """Rounded.values(dtype) (codes turned into numbers from their bits when there are many) equals
    torch's conversion of every code times its scale, rounded to dtype; so does fake_quant."""
    gen = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-20, 8, (rows,), generator=gen).float() * (1 + torch.rand(rows, generator=gen))
    x = _every_code_in_blocks(dtype, scales)
    codes, scale = fp8.act_quant(x, fmt)
    want = (codes.float() * scale.repeat_interleave(128, dim=-1)).to(dtype)
    got = fp8.Rounded.of(x, fmt).values(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays -0.0
    assert torch.equal(fp8.fake_quant(x, fmt), want)
    assert torch.equal(fp8.act_dequant(codes, scale), codes.float() * scale.repeat_interleave(128, dim=-1))


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 3e38])
def test_rounded_values_of_blocks_with_huge_or_non_finite_values(bad):
    """A block holding inf or NaN rounds to NaN codes (its scale is not finite), and a block near
    the float32 limit has a scale the bit path cannot take: both are converted as torch does."""
    x = torch.randn(256, 256)
    x[7, 3] = bad
    codes, scale = fp8.act_quant(x, "ue8m0")
    want = codes.float() * scale.repeat_interleave(128, dim=-1)
    got = fp8.Rounded.of(x, "ue8m0").values()
    assert torch.equal(got.nan_to_num(1.0, 2.0, 3.0), want.nan_to_num(1.0, 2.0, 3.0))
    assert torch.equal(got.isnan(), want.isnan())


def test_act_quant_divides_in_float32_whatever_the_input_dtype():
    """Codes and scales of a bfloat16 input are those of its exact float32 copy."""
    x = (torch.randn(16, 512) * torch.logspace(-8, 4, 512)).to(torch.bfloat16)
    for fmt in (None, "ue8m0"):
        codes, scale = fp8.act_quant(x, fmt)
        codes32, scale32 = fp8.act_quant(x.float(), fmt)
        assert torch.equal(codes.view(torch.uint8), codes32.view(torch.uint8)) and torch.equal(scale, scale32)


def plain_fp8_index(q, weights, k, k_scale):
    """fp8_index as a plain formula: torch's conversion of the codes, 256 queries at a time."""
    out = []
    for start in range(0, q.shape[1], 256):
        logits = torch.einsum("bmhd,bnd->bmnh", q[:, start : start + 256].float(), k.float()).relu_()
        out.append((logits * weights[:, start : start + 256, None, :]).sum(-1))
    return torch.cat(out, dim=1) * k_scale[:, None, :]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


@pytest.mark.parametrize("given", [True, False], ids=["q scales given", "q codes read"])
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("T,start", [(300, 0), (40, 0), (24, 9)])
def test_fp8_index_leaves_future_keys_as_the_mask_makes_them(T, start, fmt, given):
    """With a prefill's causal mask, keys after a query chunk's last query are not computed: the
    scores, once the mask is added, are those of the full computation bit for bit. With a NaN in a
    query or an infinite weight every score is computed (NaN must stay where the mask cannot hide
    it); so it is with a NaN key, whose code the fast conversion would misread."""
    gen = torch.Generator().manual_seed(T)
    q_in, k_in = torch.randn(1, T, 4, 128, generator=gen) * 3, torch.randn(1, start + T, 128, generator=gen)
    mask = torch.full((T, start + T), float("-inf")).triu_(start + 1)

    def both(q_in, k_in, poke=None):
        q, qs = fp8.act_quant(q_in, fmt)
        k, ks = fp8.act_quant(k_in, fmt)
        weights = torch.randn(1, T, 4, generator=torch.Generator().manual_seed(1)) * qs.squeeze(-1)
        weights[0, 2, 1] = 0.0  # an exact-zero tie
        if poke:
            poke(weights)
        full = plain_fp8_index(q, weights, k, ks.squeeze(-1)) + mask
        assert _same(fp8.fp8_index(q, weights, k, ks.squeeze(-1)) + mask, full)
        return full, fp8.fp8_index(q, weights, k, ks.squeeze(-1), causal_from=start, q_scale=qs.squeeze(-1) if given else None)

    full, skipped = both(q_in, k_in)
    assert torch.equal(skipped + mask, full)
    if T > 128:  # a later chunk's keys were left at -inf for the first chunk's queries
        assert torch.isneginf(skipped[0, 0, 128:]).all()
    full, skipped = both(q_in, k_in, lambda w: w.__setitem__((0, 1, 0), float("inf")))
    assert _same(skipped + mask, full)
    q_nan = q_in.clone()
    q_nan[0, 3, 2, 5] = float("nan")
    full, skipped = both(q_nan, k_in)
    assert _same(skipped + mask, full) and full.isnan().any()
    k_nan = k_in.clone()
    k_nan[0, start + 1, 7] = float("nan")
    full, skipped = both(q_in, k_nan)
    assert _same(skipped + mask, full) and full.isnan().any()
