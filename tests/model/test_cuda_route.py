"""The CUDA route (model.kernels.cuda), run on the CPU: the plain functions' bits, and no host
synchronisation per product once a weight's scales are judged."""

import contextlib
import gc

import pytest
import torch

from model import fp8, kernels
from model.kernels import cuda, weights

from .test_kernels import same

# what reads tensor values on the host, or sizes its output from them: on a GPU each waits for it
_METHODS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "unique")
_FUNCTIONS = ("equal", "allclose", "nonzero", "masked_select", "unique")


@contextlib.contextmanager
def host_reads():
    """The host reads of tensor values made under it, by name (every Python-level way to one)."""
    seen: list[str] = []

    def counted(original, name):
        def read(*args, **kwargs):
            seen.append(name)
            return original(*args, **kwargs)

        return read

    with pytest.MonkeyPatch.context() as mp:
        for name in _METHODS:
            mp.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), name))
        for name in _FUNCTIONS:
            mp.setattr(torch, name, counted(getattr(torch, name), f"torch.{name}"))
        yield seen


FORMS = {  # (weight scales, activation scales)
    "ue8m0 both": ("ue8m0", "ue8m0"),
    "amax/448 both": (None, None),
    "ue8m0 weight, amax/448 activations": ("ue8m0", None),
    "amax/448 weight, ue8m0 activations": (None, "ue8m0"),
}


@pytest.mark.parametrize("form", list(FORMS))
def test_route_gives_the_plain_functions_bits(form, monkeypatch):
    """Every FP8 function of the route against model.fp8's, bit for bit, for 1, 3, 17 and 200 rows,
    K of 3 blocks, N with a partial row block (576 rows, as kv_a_proj_with_mqa), in bfloat16 and
    float32, the rows in several chunks (a small bound on the partials) and in one."""
    wfmt, fmt = FORMS[form]
    gen = torch.Generator().manual_seed(len(form))
    w, s = fp8.weight_quant(torch.randn(576, 384, generator=gen) * 0.05, wfmt)
    assert cuda.pow2_scales(s) == (wfmt is not None)
    for rows in (1, 3, 17, 200):
        x = torch.randn(rows, 384, generator=gen)
        r = fp8.Rounded.of(x, fmt)
        want = fp8.blockwise(r.codes, r.scale, w.float(), s)
        assert same(cuda.kernel_order(r, w, s), want)
        with monkeypatch.context() as mp:  # 5 rows per chunk at most; weights dequantised 128 rows at a time
            mp.setattr(cuda, "PARTIALS_BYTES", 3 * 576 * 4 * 2 * 5)
            assert same(cuda.kernel_order(r, w, s), want)
            assert same(cuda.dequantize(w, s, torch.bfloat16), fp8.weight_dequant(w, s, torch.bfloat16))
        for dtype in (torch.bfloat16, torch.float32):
            xd = x.to(dtype)
            assert same(cuda.fp8_gemm(xd, w, s, fmt), fp8.fp8_gemm(xd, w, s, fmt))
            assert same(cuda.unrounded_gemm(xd, w, s), fp8.unrounded_gemm(xd, w, s))
            with fp8.inexact_sums():
                assert same(cuda.fp8_gemm(xd, w, s, fmt), fp8.fp8_gemm(xd, w, s, fmt))
    x = torch.randn(2, 5, 384, generator=gen).bfloat16()  # leading dimensions kept
    assert same(cuda.fp8_gemm(x, w, s, fmt), fp8.fp8_gemm(x, w, s, fmt))
    for dtype in (torch.bfloat16, torch.float32):
        assert same(cuda.weight_dequant(w, s, dtype), fp8.weight_dequant(w, s, dtype))
        assert same(cuda.fake_quant(x.to(dtype), fmt), fp8.fake_quant(x.to(dtype), fmt))


def test_the_cpus_batched_product_sums_each_block_in_order():
    """On the CPU the route forms every block's partial with one batched product of float32
    operands, rows padded to 16: where this CPU's BLAS sums those in order (checked against the
    term-by-term sum), the partials are the plain function's; where it does not, one block at a
    time by model.fp8.block_product. Either way the partials of every e4m3 code are the in-order
    sums, also for one row."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8.FP8).float()
    codes = codes[~codes.isnan()]
    gen = torch.Generator().manual_seed(5)
    a = codes[torch.randint(0, len(codes), (3, 1, 128), generator=gen)]  # (K/128, 1 row, 128)
    w = codes[torch.randint(0, len(codes), (200, 3 * 128), generator=gen)]  # (N, K)
    got = cuda.block_partials(a.bfloat16(), cuda._operand(w.bfloat16().view(200, 3, 128).permute(1, 2, 0)))
    want = torch.stack([fp8.in_order(a[j], w[:, j * 128 : (j + 1) * 128]) for j in range(3)])
    assert same(got, want)
    assert isinstance(cuda.batched_sums_in_order(), bool)


def test_no_host_read_per_product_once_the_scales_are_judged():
    """The power-of-two question costs one host read per scale tensor, the first time (a MoE
    block's experts: one for all of them); the products after it read nothing on the host."""
    gen = torch.Generator().manual_seed(7)
    cuda.batched_sums_in_order()  # this CPU's own check of its BLAS, once per process (a GPU has none)
    for wfmt, fmt in FORMS.values():
        w, s = fp8.weight_quant(torch.randn(256, 256, generator=gen) * 0.05, wfmt)
        x = torch.randn(4, 256, generator=gen).bfloat16()
        with host_reads() as seen:
            cuda.fp8_gemm(x, w, s, fmt)
        assert seen == ["__bool__"]  # fp8.is_pow2's bool(), once: the counter sees a synchronisation
        with host_reads() as seen:
            for _ in range(2):
                cuda.fp8_gemm(x, w, s, fmt)
                cuda.unrounded_gemm(x, w, s)
                cuda.weight_dequant(w, s, torch.bfloat16, keep=False)
                cuda.fake_quant(x, fmt)
                with fp8.inexact_sums():
                    cuda.fp8_gemm(x, w, s, fmt)
        assert seen == []
    experts = [fp8.weight_quant(torch.randn(128, 256, generator=gen) * 0.05, f)[1] for f in ("ue8m0", None) * 3]
    with host_reads() as seen:
        assert cuda.decide(experts) == 6 and cuda.decide(experts) == 0
    assert seen == ["tolist"]  # one copy for the six
    assert [cuda.pow2_scales(e) for e in experts] == [True, False] * 3
    experts[0].mul_(3.0)  # changed in place: judged again
    assert not cuda.pow2_scales(experts[0])
    host = fp8.weight_quant(torch.randn(128, 256, generator=gen) * 0.05, "ue8m0")[1]
    loaded = host.clone()  # a device's copy, as a loader makes it
    cuda.decide_from_host(loaded, host)
    with host_reads() as seen:
        assert cuda.pow2_scales(loaded)
    assert seen == []  # answered from the host copy


def test_copies_on_a_device_stay_within_their_budget():
    """bfloat16 copies are kept beside a device's weights up to the budget, counted, and given back
    when the weight goes; on the CPU the route keeps them as the CPU routes do (none for a weight
    used once)."""
    w, s = fp8.weight_quant(torch.randn(256, 256) * 0.05, "ue8m0")
    cuda.weight_dequant(w, s, torch.bfloat16)
    assert weights.get(w, ("dequantized", torch.bfloat16), (s,)) is not weights.MISSING
    once = kernels.use_once(fp8.weight_quant(torch.randn(128, 256) * 0.05, "ue8m0")[0])
    cuda.weight_dequant(once, s[:1], torch.bfloat16)
    assert weights.get(once, ("dequantized", torch.bfloat16), (s[:1],)) is weights.MISSING
    budget = cuda.copy_bytes()[1]
    try:
        cuda.set_copy_budget(256 * 256 * 2)  # room for one copy
        two = [fp8.weight_quant(torch.randn(256, 256) * 0.05, "ue8m0") for _ in range(2)]
        with pytest.MonkeyPatch.context() as mp:  # these CPU weights counted as a device's
            mp.setattr(cuda, "budgeted", lambda weight: True)
            held = cuda.copy_bytes()[0]
            for dw, ds in two:
                cuda.weight_dequant(dw, ds, torch.bfloat16)
            assert cuda.copy_bytes()[0] == held + 256 * 256 * 2  # the first kept, the second not: over budget
            assert weights.get(two[0][0], ("dequantized", torch.bfloat16), (two[0][1],)) is not weights.MISSING
            assert weights.get(two[1][0], ("dequantized", torch.bfloat16), (two[1][1],)) is weights.MISSING
            del two, dw, ds
            gc.collect()
            assert cuda.copy_bytes()[0] == held  # given back with the weight
        with pytest.raises(ValueError, match="budget"):
            cuda.set_copy_budget(-1)
    finally:
        cuda.set_copy_budget(budget)


def test_a_model_through_the_cuda_route_gives_the_same_trace(tiny_model, monkeypatch):
    """The tiny model's prefill and decode steps (FP8 products, the latent's FP8 round trip, the
    MQA decode's dequantised wkv_b, the experts' loop) with every FP8 function taken by the CUDA
    route, as the dispatcher takes it for CUDA tensors: every recorded value the plain one's."""
    from tracing.runner import trace_tokens

    ids = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3]
    monkeypatch.setattr(kernels, "_on", lambda t: False)  # every other function its plain one
    monkeypatch.setattr(kernels, "_fp8_route", lambda t: fp8)  # (the same threads both ways: not kernels.plain)
    want = trace_tokens(tiny_model, ids, record="default", prefill=len(ids) - 2)
    monkeypatch.setattr(kernels, "_fp8_route", lambda t: cuda)
    decided = []
    monkeypatch.setattr(cuda, "decide", lambda scales, decide=cuda.decide: decided.append(decide(scales)))
    got = trace_tokens(tiny_model, ids, record="default", prefill=len(ids) - 2)
    assert decided and set(got.tensors) == set(want.tensors)
    for name in want.tensors:
        assert same(got[name], want[name]), name
