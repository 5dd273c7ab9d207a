import pytest
import torch

from model import fp8
from model.linear import Linear


def test_act_quant_error_within_e4m3_bounds():
    torch.manual_seed(213)  # a seed where a subnormal rounds by nearly half a step
    x = torch.randn(64, 512) * torch.logspace(-3, 2, 512)
    q, s = fp8.act_quant(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (64, 4)
    back = fp8.dequant(q, s)
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
    """Bit for bit, whatever the scales: each 128-wide block's float32 partial product scaled and
    added in order, as the kernel sums it (another grouping moves outputs by an ulp, and an ulp
    can flip a selection downstream)."""
    torch.manual_seed(0)
    x = torch.randn(7, 384, dtype=torch.bfloat16)
    w, s = fp8.weight_quant(torch.randn(200, 384) * 0.05, "ue8m0" if pow2_weight_scales else None)
    assert fp8.is_pow2(s) == pow2_weight_scales
    got = fp8.fp8_gemm(x, w, s, fmt)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, kernel_order_gemm(x, w, s, fmt).to(torch.bfloat16))
    lin = Linear(384, 200, fp8.FP8, scale_fmt=fmt)
    lin.weight.data, lin.scale.data = w, s
    for _ in range(2):  # the copy the CPU route makes on first use multiplies the same way
        assert torch.equal(lin(x), got)
    rounded = fp8.Rounded.of(x, fmt)
    assert torch.equal(lin(rounded[2:5]), got[2:5])  # rows rounded once, products on a selection
    assert torch.equal(lin.dequantized(torch.bfloat16), fp8.weight_dequant(w, s, torch.bfloat16))


@pytest.mark.parametrize("fmt", [None, "ue8m0"])
def test_whole_k_sums_are_not_the_kernel_order(fmt):
    """Why the blocks are summed one by one: one float32 sum over the whole K of the dequantised
    operands differs from the kernel's, even where every scale is a power of two and dequantising
    is exact. Inside fp8.inexact_sums that is what fp8_gemm gives (and only there)."""
    torch.manual_seed(1)
    x = torch.randn(64, 1024)
    w, s = fp8.weight_quant(torch.randn(256, 1024) * 0.05, fmt)
    whole_k = fp8.dequant(*fp8.act_quant(x, fmt)) @ fp8.weight_dequant(w, s).t()
    assert not torch.equal(whole_k, kernel_order_gemm(x, w, s, fmt))
    assert torch.equal(fp8.fp8_gemm(x, w, s, fmt), kernel_order_gemm(x, w, s, fmt))
    assert not fp8.sums_inexactly()
    with fp8.inexact_sums():
        assert fp8.sums_inexactly()
        assert torch.equal(fp8.fp8_gemm(x, w, s, fmt), whole_k)
        lin = Linear(1024, 256, fp8.FP8, scale_fmt=fmt)
        lin.weight.data, lin.scale.data = w, s
        with torch.inference_mode():
            assert torch.equal(lin(x), whole_k)  # the CPU route too
    assert not fp8.sums_inexactly()


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
    """Rounded.values(dtype) equals torch's conversion of every code times its scale, rounded to
    dtype; so does fake_quant (the CPU route's decoding: tests/test_kernels.py)."""
    gen = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-20, 8, (rows,), generator=gen).float() * (1 + torch.rand(rows, generator=gen))
    x = _every_code_in_blocks(dtype, scales)
    codes, scale = fp8.act_quant(x, fmt)
    want = (codes.float() * scale.repeat_interleave(128, dim=-1)).to(dtype)
    got = fp8.Rounded.of(x, fmt).values(dtype)
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))  # -0.0 stays -0.0
    assert torch.equal(fp8.fake_quant(x, fmt), want)
    assert torch.equal(fp8.dequant(codes, scale), codes.float() * scale.repeat_interleave(128, dim=-1))


def test_act_quant_divides_in_float32_whatever_the_input_dtype():
    """Codes and scales of a bfloat16 input are those of its exact float32 copy."""
    x = (torch.randn(16, 512) * torch.logspace(-8, 4, 512)).to(torch.bfloat16)
    for fmt in (None, "ue8m0"):
        codes, scale = fp8.act_quant(x, fmt)
        codes32, scale32 = fp8.act_quant(x.float(), fmt)
        assert torch.equal(codes.view(torch.uint8), codes32.view(torch.uint8)) and torch.equal(scale, scale32)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(threads):
    """The kernel forms each output row alone; a CPU BLAS sums a product of a few rows in other
    orders (on a 2-core EPYC below 4 rows, and 5-11 rows on two threads), so a decode step's row
    would differ from the same row in a prefill. Each block's float32 partial is the in-order sum
    of its 128 products, whatever the rows beside it, the thread count or the route."""
    gen = torch.Generator().manual_seed(4)
    w, s = fp8.weight_quant(torch.randn(1536, 512, generator=gen) * 0.05, "ue8m0")
    r = fp8.Rounded.of(torch.randn(20, 512, generator=gen), "ue8m0")  # float32 activations: float32 outputs
    partial = torch.zeros(20, 4, 1536)  # each block's sum, term by term, in order
    for kb in range(4):
        for j in range(kb * 128, (kb + 1) * 128):
            partial[:, kb] += r.codes[:, j, None].float() * w[None, :, j].float()
    want = torch.zeros(20, 1536)
    for kb in range(4):
        want += partial[:, kb] * (r.scale[:, kb, None] * s.repeat_interleave(128, 0)[:, kb][None, :])
    lin = Linear(512, 1536, fp8.FP8, scale_fmt="ue8m0")
    lin.weight.data, lin.scale.data = w, s
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            assert fp8.blas_sums_in_order()
            for m in (1, 2, 3, 5, 7, 9, 11, 16, 20):
                assert torch.equal(fp8.fp8_gemm(r[:m], w, s, "ue8m0"), want[:m]), m
                assert torch.equal(lin(r[:m]), want[:m]), m  # the CPU route
    finally:
        torch.set_num_threads(before)
