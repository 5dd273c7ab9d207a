"""The CPU backend: each route gives its plain function's bits, keeps copies only where it may, and
switches off as a whole."""

import contextlib
import gc
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from model import TINY, fp8, kernels
from model.checkpoint import load_model
from model.kernels import fp8 as fast_fp8
from model.kernels import moe as fast_moe
from model.kernels import products, weights
from model.linear import Linear
from model.synthetic import SyntheticSource

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (-0.0 is not 0.0), NaN where NaN."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan() if a.dtype.itemsize > 1 else torch.zeros(a.shape, dtype=torch.bool)
    if a.dtype.itemsize > 1 and not torch.equal(nan, b.isnan()):
        return False
    bits = _BITS[a.dtype.itemsize]
    return torch.equal(a.view(bits)[~nan], b.view(bits)[~nan])


def plain(fn, *args, **kwargs):
    with kernels.plain():
        return fn(*args, **kwargs)


def routed(fn, *args, **kwargs):
    with kernels.plain(False), kernels.serial_passes():
        return fn(*args, **kwargs)


@pytest.fixture
def linear_of():
    def make(weight: torch.Tensor, scale: torch.Tensor | None = None, fmt: str | None = None) -> Linear:
        lin = Linear(weight.shape[1], weight.shape[0], weight.dtype, fmt)
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
        if scale is not None:
            lin.scale = torch.nn.Parameter(scale, requires_grad=False)
        return lin

    return make


@pytest.mark.parametrize("rows", [1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("form", ["fp8 ue8m0", "fp8 amax/448", "bf16", "float32"])
def test_linear_routes_give_the_plain_products_bits(form, dtype, rows, linear_of):
    """On this CPU's own route every product (FP8 dequantised once and laid out for oneDNN, FP8 in
    the kernel's block order over decoded codes, bf16 and float32 weights) is the plain one, bit
    for bit, also from an input rounded once and split, and again from the kept copy."""
    gen = torch.Generator().manual_seed(rows)
    w = torch.randn(320, 384, generator=gen) * 0.05
    if form.startswith("fp8"):
        fmt = "ue8m0" if form == "fp8 ue8m0" else None
        lin = linear_of(*fp8.weight_quant(w, fmt), fmt)
    else:
        lin = linear_of(w.to(torch.bfloat16 if form == "bf16" else torch.float32))
    x = torch.randn(2, rows, 384, generator=gen).to(dtype)
    # float32: a float32 product of a few rows may round by thread count (the BLAS splits its sums)
    check = same if dtype == torch.bfloat16 else lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    with torch.inference_mode(), kernels.cpu_route(True):
        want = plain(lin, x)
        for _ in range(2):  # the first call makes the copies, the second reads them
            assert check(routed(lin, x), want)
        part = lin.rounded(x)[:, : max(1, rows // 2)]  # rows rounded once, some of them multiplied
        assert check(routed(lin, part), plain(lin, part))
        assert same(routed(lin.dequantized, dtype), plain(lin.dequantized, dtype))


def test_the_float32_route_is_one_rounding_of_the_float32_product(linear_of):
    """On a CPU without bf16 units the bfloat16 products are formed in float32 and rounded once."""
    gen = torch.Generator().manual_seed(2)
    lin = linear_of((torch.randn(256, 512, generator=gen) * 0.05).to(torch.bfloat16))
    x = torch.randn(9, 512, generator=gen).to(torch.bfloat16)
    with torch.inference_mode(), kernels.cpu_route(False):
        assert same(routed(lin, x), F.linear(x.float(), lin.weight.float()).to(torch.bfloat16))
        a, b = torch.randn(4, 8, 64, generator=gen).bfloat16(), torch.randn(4, 64, 32, generator=gen).bfloat16()
        assert same(routed(kernels.matmul, a, b), torch.matmul(a.float(), b.float()).to(torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("rows", [4, 256], ids=["few values", "many values"])
def test_fp8_decoding_routes_are_the_plain_values(dtype, fmt, rows):
    """Codes decoded from their bits (or a table) are torch's conversion, for every code, -0.0 and
    subnormals included: Rounded values, the KV latent's FP8 round trip, weight dequantisation."""
    gen = torch.Generator().manual_seed(3)
    scales = 2.0 ** torch.randint(-20, 8, (rows,), generator=gen).float() * (1 + torch.rand(rows, generator=gen))
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).float()
    values = values[~values.isnan()]
    x = values.repeat(2)[:256].view(2, 128).repeat(rows // 2, 1)
    x[0, :3] = torch.tensor([0.0, -0.0, 2.0**-12])
    x = (x * scales[:, None]).to(dtype)
    r = fp8.Rounded.of(x, fmt)
    assert same(fast_fp8.values(r, dtype), fp8.dequant(r.codes, r.scale, dtype))
    assert same(routed(kernels.fake_quant, x, fmt), plain(kernels.fake_quant, x, fmt))
    w, s = fp8.weight_quant(torch.randn(200, 384, generator=gen) * 0.05, fmt)
    for d in (torch.bfloat16, torch.float32):
        assert same(fast_fp8.weight_dequant(w, s, d), fp8.weight_dequant(w, s, d))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).reshape(4, 64)
    for t in (codes, codes[:, ::3]):  # contiguous and strided
        assert same(fast_fp8.to_float(t), t.float())


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), 3e38])
def test_fp8_decoding_of_blocks_with_huge_or_non_finite_values(bad):
    """A block holding inf or NaN rounds to NaN codes (its scale is not finite), and a block near
    the float32 limit has a scale the bit path cannot take: both are converted as torch does."""
    x = torch.randn(256, 256)
    x[7, 3] = bad
    r = fp8.Rounded.of(x, "ue8m0")
    assert same(fast_fp8.values(r, torch.float32), fp8.dequant(r.codes, r.scale))


@pytest.mark.parametrize("given", [True, False], ids=["q scales given", "q codes read"])
@pytest.mark.parametrize("fmt", [None, "ue8m0"])
@pytest.mark.parametrize("T,start", [(300, 0), (40, 0), (24, 9), (1, 40)])
def test_index_scores_route_leaves_future_keys_as_the_mask_makes_them(T, start, fmt, given):
    """With a prefill's causal mask, keys after a query chunk's last query are not computed: the
    scores, once the mask is added, are the plain ones bit for bit. With a NaN in a query or an
    infinite weight every score is computed (NaN must stay where the mask cannot hide it); so it
    is with a NaN key, whose code the bit decoding would misread."""
    gen = torch.Generator().manual_seed(T)
    q_in, k_in = torch.randn(1, T, 4, 128, generator=gen) * 3, torch.randn(1, start + T, 128, generator=gen)
    mask = torch.full((T, start + T), float("-inf")).triu_(start + 1) if T > 1 else torch.zeros(1, start + T)
    causal_from = start if T > 1 else None

    def both(q_in, k_in, poke=None):
        q, qs = fp8.act_quant(q_in, fmt)
        k, ks = fp8.act_quant(k_in, fmt)
        weights_ = torch.randn(1, T, 4, generator=torch.Generator().manual_seed(1)) * qs.squeeze(-1)
        weights_[0, 0, 1] = 0.0  # an exact-zero tie
        if poke:
            poke(weights_)
        full = fp8.fp8_index(q, weights_, k, ks.squeeze(-1)) + mask
        q_scale = qs.squeeze(-1) if given else None
        return full, routed(kernels.fp8_index, q, weights_, k, ks.squeeze(-1), causal_from, q_scale) + mask

    full, skipped = both(q_in, k_in)
    assert same(skipped, full)
    if T > 128:  # a later chunk's keys were left at -inf for the first chunk's queries
        q, qs = fp8.act_quant(q_in, fmt)
        k, ks = fp8.act_quant(k_in, fmt)
        raw = fast_fp8.fp8_index(q, torch.ones(1, T, 4) * qs.squeeze(-1), k, ks.squeeze(-1), start, qs.squeeze(-1))
        assert torch.isneginf(raw[0, 0, 128:]).all()
    full, skipped = both(q_in, k_in, lambda w: w.__setitem__((0, 0, 0), float("inf")))
    assert same(skipped, full)
    q_nan = q_in.clone()
    q_nan[0, 0, 2, 5] = float("nan")
    full, skipped = both(q_nan, k_in)
    assert same(skipped, full) and full.isnan().any()
    k_nan = k_in.clone()
    k_nan[0, start, 7] = float("nan")
    full, skipped = both(q_in, k_nan)
    assert same(skipped, full) and full.isnan().any()


def test_small_routes_are_the_plain_functions():
    """Top-k (ties to the lower index, as CUDA), einsum, matmul, gather and the Hadamard rotation."""
    gen = torch.Generator().manual_seed(4)
    x = torch.tensor([[0.0, 3.0, 0.0, 0.0, 1.0, 0.0]])
    for fn in (plain, routed):
        assert fn(kernels.topk, x, 4)[1].tolist() == [[1, 4, 0, 2]]
    scores = torch.randn(3, 700, generator=gen).relu()
    assert all(same(a, b) for a, b in zip(routed(kernels.topk, scores, 50), plain(kernels.topk, scores, 50), strict=True))
    for dtype in (torch.bfloat16, torch.float32):
        with kernels.cpu_route(True):
            q, k = torch.randn(1, 9, 4, 64, generator=gen).to(dtype), torch.randn(1, 9, 4, 64, generator=gen).to(dtype)
            assert same(routed(kernels.einsum, "bshd,bthd->bsht", q, k), torch.einsum("bshd,bthd->bsht", q, k))
            assert same(routed(kernels.matmul, q[0], k[0].transpose(1, 2)), torch.matmul(q[0], k[0].transpose(1, 2)))
            rows = torch.tensor([3, 0, 3, 8])
            assert same(routed(kernels.gather, q[0], rows), q[0].index_select(0, rows))
            assert same(routed(kernels.hadamard, q), fp8.hadamard(q))


def reference_moe_loop(moe, x, weights_, indices):
    """The reference's loop: for each expert in ascending order, y[tokens] += w2(silu(w1 x) * w3 x) * weight."""
    loop = torch.zeros_like(x, dtype=torch.float32)
    for i, e in enumerate(moe.experts):
        rows, slot = torch.where(indices == i)
        if len(rows):
            h = (F.silu(e.w1(x[rows]).float()) * e.w3(x[rows]).float()).type_as(x)
            loop.index_add_(0, rows, e.w2(h) * weights_[rows, slot, None])
    return loop


@pytest.mark.parametrize("native", [True, False], ids=["native bf16", "float32 route"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weights_form", ["fp8", "fp8 whole-K sums", "bf16", "float32", "fp8 amax/448 scales"])
def test_expert_route_is_the_reference_loop_bit_for_bit(tiny_source, dtype, weights_form, native):
    """The experts prepared together ([w1; w3] as one product, packed for oneDNN or stacked, split
    among the threads) give the reference's loop: each expert in ascending order, y[tokens] +=
    w2(silu(w1 x) * w3 x) * weight, its products on the same route. Where they cannot (float32
    weights, FP8 products summed in the kernel's block order) the block's own loop runs."""
    source = {
        "fp8": tiny_source,
        "fp8 whole-K sums": tiny_source,
        "bf16": SyntheticSource(TINY.replace(dtype="bf16"), seed=1),
        "float32": SyntheticSource(TINY.replace(dtype="bf16"), seed=1),
        "fp8 amax/448 scales": SyntheticSource(TINY.replace(scale_fmt=None), seed=1),
    }[weights_form]
    moe = load_model(source, dtype=dtype).layers[1].ffn
    if weights_form == "float32":  # as a float32 checkpoint (e.g. the demo's unquantised weights) loads
        for lin in (m for m in moe.modules() if isinstance(m, Linear)):
            lin.weight = torch.nn.Parameter(lin.weight.float(), requires_grad=False)
    x = torch.randn(37, TINY.dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    whole_k = fp8.inexact_sums() if weights_form == "fp8 whole-K sums" else contextlib.nullcontext()
    with torch.inference_mode(), kernels.cpu_route(native), whole_k:
        weights_, indices = moe.gate(x)
        want = routed(reference_moe_loop, moe, x, weights_, indices)  # float32 products may round by thread count
        assert torch.equal(routed(moe.route, x, weights_, indices), want)
        assert torch.equal(plain(moe.route, x, weights_, indices), plain(reference_moe_loop, moe, x, weights_, indices))
        prepared = fast_moe._prepared(moe.experts, dtype)
        assert (prepared is None) == (weights_form in ("float32", "fp8", "fp8 amax/448 scales"))
        if weights_form in ("fp8", "fp8 amax/448 scales"):  # the kernel's block order: the CPU's own route
            assert fast_moe.experts(moe.experts, fp8.Rounded.of(x, moe.scale_fmt), *route_rows(moe, indices), dtype) is not None
        if prepared is not None:
            assert (prepared.packed13 is not None) == (
                products.product_dtype(dtype) == torch.bfloat16 and products.packed_products_agree()
            )
            assert fast_moe._prepared(moe.experts, dtype) is prepared  # kept while the experts hold the same weights


@pytest.mark.parametrize("whole_k", [False, True], ids=["kernel order", "whole-K sums"])
def test_unrounded_experts_with_amax_scales_are_the_reference_loop(whole_k):
    """Unrounded activations (--no-act-fp8, DeepSeek-V3's products) multiply each FP8 weight
    dequantised to the activations' dtype first when its scales are not powers of two: the experts'
    route takes that product too, whether or not FP8 sums are asked to be inexact."""
    moe = load_model(SyntheticSource(TINY.replace(scale_fmt=None), seed=1)).layers[1].ffn
    x = torch.randn(37, TINY.dim, generator=torch.Generator().manual_seed(0)).bfloat16()
    inexact = fp8.inexact_sums() if whole_k else contextlib.nullcontext()
    with torch.inference_mode(), fp8.unrounded_activations(), inexact:
        weights_, indices = moe.gate(x)
        assert torch.equal(routed(moe.route, x, weights_, indices), routed(reference_moe_loop, moe, x, weights_, indices))


def route_rows(moe, indices: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The (token, expert) rows sorted by expert and the count of each, as MoE.route makes them."""
    flat = indices.flatten()
    order = torch.argsort(flat, stable=True)
    return order // indices.shape[1], torch.bincount(flat, minlength=moe.n_routed_experts).tolist()


def test_copies_are_kept_with_their_weight_and_go_with_it(linear_of):
    """A copy lives as long as its weight: made once, made again when the weight's data changes,
    never for a weight used once (streamed), trained, or off the CPU, and freed with the weight."""
    w, s = fp8.weight_quant(torch.randn(256, 256) * 0.05, "ue8m0")
    lin = linear_of(w, s, "ue8m0")
    x = torch.randn(3, 256).to(torch.bfloat16)
    with torch.inference_mode():
        first = routed(lin, x)
        kept = ("dequantized", torch.float32)  # power-of-two scales: the blocks multiply the dequantised weight
        copy = weights.get(lin.weight, kept, (lin.scale,))
        assert copy is not weights.MISSING
        assert weights.get(lin.weight, kept, (lin.scale,)) is copy
    w2, s2 = fp8.weight_quant(torch.randn(256, 256) * 0.05, "ue8m0")
    lin.weight.data, lin.scale.data = w2, s2  # in place: the same parameters, other values
    with torch.inference_mode():
        assert same(routed(lin, x), plain(lin, x)) and not torch.equal(routed(lin, x), first)
    once = linear_of(*fp8.weight_quant(torch.randn(128, 256) * 0.05, "ue8m0"), "ue8m0")
    kernels.use_once(once.weight)
    with torch.inference_mode():
        routed(once, x)
    assert weights.get(once.weight, ("dequantized", torch.float32), (once.scale,)) is weights.MISSING
    trained = Linear(256, 64)
    torch.nn.init.normal_(trained.weight)
    assert trained.weight.requires_grad
    y = routed(trained, torch.randn(2, 256).bfloat16())
    y.float().sum().backward()  # the plain product: gradients reach the weight
    assert trained.weight.grad is not None and not weights.keeps(trained.weight)
    held = len(weights._KEPT)
    del lin, first, copy
    gc.collect()
    assert len(weights._KEPT) < held


def test_a_model_both_ways_gives_the_same_trace(tiny_model):
    """Every recorded value of a prefill, decode steps and an attribution is the same bit for bit
    with the CPU routes and with the plain functions (bfloat16, this CPU's own route)."""
    from tracing.analyses.attribution import AttributionRequest
    from tracing.runner import trace_tokens

    ids = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400, 11, 76, 5, 17]
    with kernels.cpu_route(True):
        a = trace_tokens(tiny_model, ids, record="default,flow", prefill=len(ids) - 3, attribution=AttributionRequest())
        with kernels.plain():
            b = trace_tokens(tiny_model, ids, record="default,flow", prefill=len(ids) - 3, attribution=AttributionRequest())
    assert set(a.tensors) == set(b.tensors) and any(n.endswith("topk_indices") for n in a.tensors)
    for name in a.tensors:
        assert same(a[name], b[name]), name


def test_plain_switches_every_route_off():
    """ANATOMY_KERNELS=plain, read once per process: in a fresh one the model computes with plain
    PyTorch (no copy is kept) and ``info`` says so."""
    code = (
        "import json, torch; from model import TINY, kernels; from model.checkpoint import load_model; "
        "from model.synthetic import SyntheticSource; from model.kernels import weights; "
        "m = load_model(SyntheticSource(TINY, seed=1)); m(torch.tensor([[1, 2, 3]])); "
        "print(json.dumps({'kept': len(weights._KEPT), **kernels.describe()}))"
    )
    env = {"ANATOMY_KERNELS": "plain", "PATH": "/usr/bin:/bin"}
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout)
    assert out["kept"] == 0 and out["cpu_kernels"] == "plain PyTorch (ANATOMY_KERNELS=plain)"


def test_an_unknown_setting_keeps_the_routes_and_is_said(env_read_once, tiny_model):
    env_read_once(kernels.ENV, "fast", kernels.setting)
    assert kernels.enabled()
    with torch.inference_mode():
        tiny_model(torch.tensor([[1, 2, 3]]))
    assert (
        weights._KEPT
        and kernels.describe()["cpu_kernels"] == "CPU routes (model.kernels); ANATOMY_KERNELS='fast' ignored: say plain"
    )
