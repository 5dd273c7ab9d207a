"""The CPU's bfloat16 products: one decision by capability, an override, and no selection moved."""

import json
import subprocess
import sys

import pytest
import torch

from model import kernels
from model.checkpoint import load_model
from model.kernels import products
from tracing.runner import trace_tokens
from tracing.tokenizer import Tokenizer

DEMO_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is "
    "so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters."
)


@pytest.fixture
def route_env(env_read_once):
    """Sets ANATOMY_CPU_BF16 as a process starting now would find it (it is read once per process)."""
    return lambda value: env_read_once(products.ROUTE_ENV, value, products.route_setting)


def test_the_route_follows_the_cpu_and_the_override(route_env, monkeypatch):
    route_env(None)
    assert products.native_bf16() == products.has_bf16_units()
    assert products.product_dtype(torch.float32) == torch.float32 and products.product_dtype(torch.float16) == torch.float32
    route_env("float32")
    assert not products.native_bf16() and products.product_dtype(torch.bfloat16) == torch.float32
    assert products.describe_route() == f"float32, rounded once ({products.ROUTE_ENV}=float32)"
    monkeypatch.setenv(products.ROUTE_ENV, "native")  # read once: products do not look at the environment again
    assert not products.native_bf16()
    route_env("native")
    assert products.native_bf16() and products.product_dtype(torch.bfloat16) == torch.bfloat16
    with products.cpu_route(False):
        assert not products.native_bf16()
    route_env("fast")
    assert products.native_bf16() == products.has_bf16_units() and "'fast' ignored" in products.describe_route()


def test_info_names_the_route_and_the_threads():
    env = {"ANATOMY_CPU_BF16": "float32", "ANATOMY_PARALLEL_WORK": "0", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "tracing", "info", "--config", "assets/configs/config_671B_hf.json"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    ).stdout
    info = json.loads(out)
    assert info["cpu_products"] == "float32, rounded once (ANATOMY_CPU_BF16=float32)"
    assert info["cpu_threads"] == "1 thread" or info["cpu_threads"].endswith("for every pass (ANATOMY_PARALLEL_WORK=0)")
    assert info["cpu_kernels"] == "CPU routes (model.kernels)"


def _both_routes(model, ids):
    with products.cpu_route(False):
        exact = trace_tokens(model, ids, prefill=len(ids) - 3)
    with products.cpu_route(True):
        native = trace_tokens(model, ids, prefill=len(ids) - 3)
    return exact, native


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_native_bf16_products_move_no_selection(which, tiny_model, app_checkpoint):
    """The two routes round each product once from float32 sums formed in another order: on the
    tiny and demo checkpoints (prefill and decode steps) every selection is the same and the
    logits agree to bfloat16 rounding."""
    if which == "tiny":
        model, ids = tiny_model, [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400, 11, 76, 5, 17]
    else:
        path = "assets/demo" if app_checkpoint == "demo" else app_checkpoint
        model, ids = load_model(path), Tokenizer(path).encode(DEMO_PROMPT)
    exact, native = _both_routes(model, ids)
    selections = [n for n in exact.tensors if n.endswith(("topk_indices", ".groups"))]
    assert selections
    for name in selections:
        assert torch.equal(exact[name], native[name]), name
    logits_a, logits_b = exact["logits.last"], native["logits.last"]
    assert (logits_a - logits_b).abs().max() <= 0.02 * logits_a.abs().max()
    assert logits_a.argmax() == logits_b.argmax()


def test_packed_products_give_the_plain_products_bits():
    """Weights laid out once for oneDNN are used only where this machine multiplies them to
    F.linear's bits; a bfloat16 Linear on the CPU then gives F.linear's bits through them."""
    import torch.nn.functional as F

    from model.linear import Linear

    assert products.pack(torch.randn(64, 128)) is None  # float32 products keep their own route
    if not products.packed_products_agree():
        assert products.pack(torch.randn(64, 128).to(torch.bfloat16)) is None
        return
    gen = torch.Generator().manual_seed(5)
    for rows, k, n in ((1, 1024, 512), (7, 256, 2048), (129, 512, 320)):
        weight = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        x = torch.randn(1, rows, k, generator=gen).to(torch.bfloat16)
        assert torch.equal(products.linear(x, None, products.pack(weight)), F.linear(x, weight))
        lin = Linear(k, n)
        lin.weight = torch.nn.Parameter(weight, requires_grad=False)
        with torch.inference_mode(), products.cpu_route(True):
            assert torch.equal(lin(x), F.linear(x, weight))
            assert kernels.weights.get(lin.weight, ("packed", torch.bfloat16)) is not kernels.weights.MISSING
