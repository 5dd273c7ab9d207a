"""The FP8 products of one block at the 671B's real widths against the kernel's arithmetic.

The tiny fixtures cannot show how a float32 sum is grouped: their products are a few blocks wide.
Here every FP8 product of the real model's first block (hidden 7168, 128 heads, the indexer's 64 x
128; a dense FFN of the experts' width to keep it light) is checked against a float32 computation
written from the reference's ``fp8_gemm`` kernel, for power-of-two (UE8M0) scales, as the real
checkpoint has, and for amax/448 ones, on the CPU routes and in model.fp8's plain product.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import fp8, kernels
from model.checkpoint import load_model
from model.config import ModelArgs
from model.linear import Linear
from model.synthetic import SyntheticSource

CONFIG = Path(__file__).resolve().parents[2] / "assets" / "configs" / "config_671B_hf.json"
TOKENS = 16  # rows enough that every float32 product of a block sums its 128 terms in order


def kernel_gemm(codes: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``fp8_gemm``'s arithmetic: for each 128-wide block of K the float32 product of the FP8 codes,
    times (activation scale x weight scale), added to a float32 sum that starts at zero."""
    m, k = codes.shape
    n = w.shape[0]
    partial = torch.einsum("mkb,nkb->kmn", codes.float().view(m, k // 128, 128), w.float().view(n, k // 128, 128))
    w_scale = w_scale.repeat_interleave(128, 0)[:n].t()  # (K/128, N): each output row's block scale
    out = torch.zeros(m, n)
    for kb in range(k // 128):
        out += partial[kb] * (a_scale[:, kb, None] * w_scale[kb][None, :])
    return out


@pytest.fixture(scope="module")
def block():
    """The real model's block 0 (MLA with the indexer, a dense FFN of width 2048), synthetic UE8M0 weights."""
    args = ModelArgs.from_file(CONFIG).replace(n_layers=1, n_dense_layers=1, inter_dim=2048, vocab_size=1024, n_mtp_layers=0)
    return load_model(SyntheticSource(args, seed=7))


def products_of(model, ids: torch.Tensor) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Every FP8 product of a forward: (name, input codes, input scales, output), with the input as
    the product rounded it (act_quant of the input, or the rounding it was handed)."""
    seen = []

    def keep(name):
        def hook(module, args, out):
            x = args[0]
            r = x if isinstance(x, fp8.Rounded) else fp8.Rounded.of(x, module.scale_fmt)
            k = r.codes.shape[-1]
            seen.append((name, r.codes.reshape(-1, k), r.scale.reshape(-1, k // 128), out.reshape(-1, out.shape[-1])))

        return hook

    fp8_linears = [(n, m) for n, m in model.named_modules() if isinstance(m, Linear) and m.scale is not None]
    handles = [m.register_forward_hook(keep(n)) for n, m in fp8_linears]
    try:
        with torch.inference_mode():
            model(ids)
    finally:
        for h in handles:
            h.remove()
    return seen


def amax_scales(model, on: bool) -> None:
    """Weight scales that are not powers of two, and activations scaled by amax / 448 (the other
    format), or back to UE8M0."""
    for m in model.modules():
        if isinstance(m, Linear) and m.scale is not None:
            if on:
                m.ue8m0_scale = m.scale.data.clone()
                m.scale.data.mul_(1 + torch.rand(m.scale.shape, generator=torch.Generator().manual_seed(m.in_features)))
            else:
                m.scale.data.copy_(m.ue8m0_scale)
            m.scale_fmt = None if on else "ue8m0"


def routes() -> dict:
    """The CPU routes this machine runs by default: the float32 one everywhere, the native bfloat16
    one where the CPU has bf16 units (forced elsewhere, its bfloat16 products crawl)."""
    found = {"float32 route": lambda: kernels.cpu_route(False)}
    if kernels.products.has_bf16_units():
        found["native bf16"] = lambda: kernels.cpu_route(True)
    return found


# amax/448 under -m slow (16 s in the suite): the default run keeps the plain product at real width
# with those scales, below, and the CPU routes with them at the tiny width (tests/model/test_kernels.py)
@pytest.mark.parametrize("scales", ["ue8m0", pytest.param("amax/448", marks=pytest.mark.slow)])
def test_every_product_of_a_real_width_block_sums_as_the_kernel(block, scales):
    ids = torch.randint(0, 1024, (1, TOKENS), generator=torch.Generator().manual_seed(3))
    linears = {n: m for n, m in block.named_modules() if isinstance(m, Linear) and m.scale is not None}
    if scales == "amax/448":
        amax_scales(block, True)
    try:
        first = None
        for route, context in routes().items():
            with context():
                seen = products_of(block, ids)
            assert sorted(name for name, *_ in seen) == sorted(linears)  # every FP8 product ran
            for i, (name, codes, a_scale, out) in enumerate(seen):
                if first is not None and torch.equal(codes, first[i][1]) and torch.equal(a_scale, first[i][2]):
                    assert torch.equal(out, first[i][3]), f"{route}: {name}"  # the same input, the same output
                    continue  # (an input differs where an earlier bfloat16 product of this route summed otherwise)
                want = kernel_gemm(codes, a_scale, linears[name].weight, linears[name].scale).to(out.dtype)
                assert torch.equal(out, want), f"{route}: {name} ({codes.shape[0]} x {codes.shape[1]} -> {out.shape[1]})"
            first = first or seen
    finally:
        if scales == "amax/448":
            amax_scales(block, False)


@pytest.mark.parametrize("scales", ["ue8m0", "amax/448"])
def test_the_plain_product_at_real_width_sums_as_the_kernel(block, scales):
    """model.fp8's own fp8_gemm (what ANATOMY_KERNELS=plain and a GPU run), on the block's output
    projection: 16384 wide, 128 blocks summed (its first 256 outputs: the sum's grouping is along
    K, and each output row sums alone). The test can tell: summing the whole K at once
    (fp8.inexact_sums) moves some of its outputs."""
    lin = block.layers[0].attn.wo
    x = torch.randn(TOKENS, lin.in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    weight, scale = lin.weight[:256], lin.scale[:2]  # (256, 16384) and its (2, 128) block scales
    if scales == "amax/448":
        scale = scale * (1 + torch.rand(scale.shape, generator=torch.Generator().manual_seed(6)))
    fmt = "ue8m0" if scales == "ue8m0" else None
    r = fp8.Rounded.of(x, fmt)
    with torch.inference_mode():
        got = fp8.fp8_gemm(r, weight, scale, fmt)
    assert torch.equal(got, kernel_gemm(r.codes, r.scale, weight, scale).bfloat16())
    with torch.inference_mode(), fp8.inexact_sums():
        assert not torch.equal(fp8.fp8_gemm(r, weight, scale, fmt), got)
