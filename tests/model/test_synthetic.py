"""The synthetic source: exactly the real checkpoint's names, shapes and dtypes, deterministic
values, truncation to the first blocks, and real-width blocks that load and run."""

from __future__ import annotations

import gzip
import math
from pathlib import Path

import pytest
import torch

from model import TINY
from model.checkpoint import build_model, expected_specs, materialize, stored_dtype, validate
from model.config import ConfigError, ModelArgs
from model.names import layer_of, to_hf
from model.stream import model_bytes
from model.synthetic import SyntheticSource, synthetic_source, truncate_layers

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "assets" / "configs" / "config_671B_hf.json"
REAL_NAMES = REPO / "assets" / "configs" / "real_weight_names.txt.gz"
F8, BF16, F32 = torch.float8_e4m3fn, torch.bfloat16, torch.float32

# Shapes and dtypes of deepseek-ai/DeepSeek-V3.2-Exp's safetensors headers (one of each kind).
REAL = {
    "model.embed_tokens.weight": ((129280, 7168), BF16),
    "model.layers.0.input_layernorm.weight": ((7168,), F32),
    "model.layers.0.self_attn.q_a_proj.weight": ((1536, 7168), F8),
    "model.layers.0.self_attn.q_a_proj.weight_scale_inv": ((12, 56), F32),
    "model.layers.0.self_attn.q_a_layernorm.weight": ((1536,), F32),
    "model.layers.0.self_attn.q_b_proj.weight": ((24576, 1536), F8),
    "model.layers.0.self_attn.q_b_proj.weight_scale_inv": ((192, 12), F32),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ((576, 7168), F8),
    "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv": ((5, 56), F32),
    "model.layers.0.self_attn.kv_a_layernorm.weight": ((512,), F32),
    "model.layers.0.self_attn.kv_b_proj.weight": ((32768, 512), F8),
    "model.layers.0.self_attn.kv_b_proj.weight_scale_inv": ((256, 4), F32),
    "model.layers.0.self_attn.o_proj.weight": ((7168, 16384), F8),
    "model.layers.0.self_attn.o_proj.weight_scale_inv": ((56, 128), F32),
    "model.layers.0.self_attn.indexer.wq_b.weight": ((8192, 1536), F8),
    "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv": ((64, 12), F32),
    "model.layers.0.self_attn.indexer.wk.weight": ((128, 7168), F8),
    "model.layers.0.self_attn.indexer.k_norm.weight": ((128,), F32),
    "model.layers.0.self_attn.indexer.k_norm.bias": ((128,), F32),
    "model.layers.0.self_attn.indexer.weights_proj.weight": ((64, 7168), BF16),
    "model.layers.0.mlp.gate_proj.weight": ((18432, 7168), F8),
    "model.layers.0.mlp.down_proj.weight": ((7168, 18432), F8),
    "model.layers.0.mlp.down_proj.weight_scale_inv": ((56, 144), F32),
    "model.layers.3.mlp.gate.weight": ((256, 7168), BF16),
    "model.layers.3.mlp.gate.e_score_correction_bias": ((256,), F32),
    "model.layers.3.mlp.experts.0.gate_proj.weight": ((2048, 7168), F8),
    "model.layers.3.mlp.experts.255.down_proj.weight": ((7168, 2048), F8),
    "model.layers.3.mlp.experts.255.down_proj.weight_scale_inv": ((56, 16), F32),
    "model.layers.60.mlp.shared_experts.up_proj.weight": ((2048, 7168), F8),
    "model.norm.weight": ((7168,), F32),
    "lm_head.weight": ((129280, 7168), BF16),
}


@pytest.fixture(scope="module")
def real_args() -> ModelArgs:
    return ModelArgs.from_file(CONFIG)


@pytest.fixture(scope="module")
def real_source(real_args) -> SyntheticSource:
    return SyntheticSource(real_args)


def test_every_671b_tensor_has_the_name_shape_and_dtype_the_loader_expects(real_args, real_source):
    """Every tensor, on the meta device, against the real checkpoint's names, the real shapes of
    one tensor of each kind, and the parameters of a model built apart: blocks 0-5 (dense and
    MoE) directly, the later blocks through block 5, whose tensors they repeat."""
    made = {}
    for name in real_source.specs():
        tensor = real_source.load(name, "meta")
        made[name] = (tuple(tensor.shape), tensor.dtype)
    real_names = {line.strip() for line in gzip.open(REAL_NAMES, "rt") if not line.startswith("#")}
    assert set(made) == {n for n in real_names if not n.startswith("model.layers.61.")}  # MTP layer skipped
    for name, spec in REAL.items():
        assert made[name] == spec, name
    model = build_model(truncate_layers(real_args, 6))
    want = {to_hf(name): (tuple(p.shape), stored_dtype(name, p.dtype)) for name, p in model.named_parameters()}
    assert validate(model, real_source)  # the loader's own check
    for name, spec in made.items():
        layer = layer_of(name)
        if layer is not None and layer > 5:
            name = name.replace(f"model.layers.{layer}.", "model.layers.5.", 1)
        assert want[name] == spec, name
    assert 670e9 < model_bytes(real_source, "cuda") < 680e9  # 690 GB on disk with the MTP layer


def test_real_width_tensors_of_every_kind_are_drawn_as_specified(real_source):
    """The drawing code itself, at real width, for the tensors of a MoE block up to 2M elements:
    every branch (FP8 weights, block scales, bfloat16 weights, norms, the router's bias); the
    larger matrices take the FP8 branch too."""
    kinds = [n for n in real_source.specs() if n.startswith("model.layers.3.") and ".experts." not in n]
    kinds += [n for n in real_source.specs() if n.startswith("model.layers.3.mlp.experts.0.")]
    drawn = 0
    for name in kinds:
        spec = real_source.specs()[name]
        if math.prod(spec.shape) > 2_000_000:
            continue
        tensor = real_source.load(name)
        assert (tuple(tensor.shape), tensor.dtype) == (spec.shape, spec.dtype), name
        assert torch.isfinite(tensor.float()).all(), name
        drawn += 1
    assert drawn >= 20 and {real_source.specs()[n].dtype for n in kinds} == {F8, BF16, F32}


def test_truncation_keeps_the_first_blocks_with_the_same_values():
    assert truncate_layers(TINY, 2).n_layers == 2 and truncate_layers(TINY, 2).n_dense_layers == 1
    real = ModelArgs.from_file(CONFIG)
    four, two = truncate_layers(real, 4), truncate_layers(real, 2)
    assert (four.n_layers, four.n_dense_layers, four.n_moe_layers) == (4, 3, 1)
    assert (two.n_layers, two.n_dense_layers, two.n_moe_layers) == (2, 2, 0)
    with pytest.raises(ConfigError, match="between 1 and 61"):
        truncate_layers(real, 62)
    with pytest.raises(ConfigError, match="between 1 and 61"):
        truncate_layers(real, 0)
    whole, cut = SyntheticSource(TINY, seed=4), SyntheticSource(truncate_layers(TINY, 2), seed=4)
    assert set(cut.specs()) < set(whole.specs()) and not any(".layers.2." in n for n in cut.specs())
    for name in ("model.layers.1.mlp.experts.3.up_proj.weight", "model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(cut.load(name).view(torch.uint8), whole.load(name).view(torch.uint8))
    assert synthetic_source(CONFIG, n_layers=4).args == four
    assert set(expected_specs(four)) == set(synthetic_source(CONFIG, n_layers=4).specs())


def test_values_are_deterministic_and_scaled_like_trained_weights():
    a, b, c = SyntheticSource(TINY, seed=1), SyntheticSource(TINY, seed=1), SyntheticSource(TINY, seed=2)
    name = "model.layers.1.self_attn.wq_b.weight".replace("wq_b", "q_b_proj")
    assert torch.equal(a.load(name).view(torch.uint8), b.load(name).view(torch.uint8))
    assert not torch.equal(a.load(name).view(torch.uint8), c.load(name).view(torch.uint8))
    scale = a.load(name + "_scale_inv")
    assert torch.equal(scale, 2.0 ** torch.log2(scale).round())  # ue8m0: powers of two
    from model.fp8 import weight_dequant

    w = weight_dequant(a.load(name), scale)
    assert 0.5 < w.std().item() * TINY.q_lora_rank**0.5 < 2.0  # about 1/sqrt(fan_in)


def test_real_width_pieces_load_and_run(real_args, real_source):
    """A real-width router, expert and indexer projection from the synthetic 671B source, on the CPU."""
    args = truncate_layers(real_args, 4)
    model = build_model(args)
    moe = model.layers[3].ffn
    read = materialize(moe.gate, real_source, "cpu", prefix="layers.3.ffn.gate")
    read += materialize(moe.experts[0], real_source, "cpu", prefix="layers.3.ffn.experts.0")
    wk = model.layers[3].attn.indexer.wk
    read += materialize(wk, real_source, "cpu", prefix="layers.3.attn.indexer.wk")
    assert read == 256 * 7168 * 2 + 256 * 4 + 3 * (2048 * 7168 + 16 * 56 * 4) + 128 * 7168 + 56 * 4
    x = torch.randn(2, 7168, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        weights, indices = moe.gate(x)
        y = moe.experts[0](x)
        k = wk(x)
    assert indices.shape == (2, 8) and torch.allclose(weights.sum(-1), torch.full((2,), 2.5))
    assert y.shape == (2, 7168) and y.dtype == torch.bfloat16 and torch.isfinite(y).all()
    assert k.shape == (2, 128) and 0.3 < k.float().std().item() < 3  # activations of order one
