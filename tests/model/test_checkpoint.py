"""Loading the Hugging Face layout: round trip, lazy reads, and a clear error for every bad checkpoint."""

import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import TINY
from model.checkpoint import CheckpointError, SafetensorsSource, built_specs, expected_specs, load_model, save_checkpoint
from model.config import ModelArgs
from model.names import to_hf
from model.synthetic import SyntheticSource, v3_layout

REAL_NAMES = Path(__file__).resolve().parents[2] / "assets" / "configs" / "real_weight_names.txt.gz"
NORMS = ("layernorm.weight", "model.norm.weight", "k_norm.weight", "k_norm.bias")  # float32 in the checkpoint


def test_saved_checkpoint_has_the_real_layout(tiny_checkpoint):
    files = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model_type"] == "deepseek_v32" and config["quantization_config"]["scale_fmt"] == "ue8m0"
    tensors = load_file(str(tiny_checkpoint / "model-00001-of-00002.safetensors"))
    w = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"]
    s = tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"]
    assert w.dtype == torch.float8_e4m3fn and w.shape == (192, 256) and s.shape == (2, 2)  # partial row block
    assert tensors["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16


def test_loaded_checkpoint_gives_the_same_logits(tiny_model, tiny_checkpoint, tokens):
    loaded = load_model(tiny_checkpoint)
    with torch.inference_mode():
        assert torch.equal(loaded(tokens, all_logits=True), tiny_model(tokens, all_logits=True))


def test_names_shapes_and_dtypes_match_the_real_671b_checkpoint():
    args = ModelArgs.from_file("assets/configs/config_671B_hf.json")
    specs = expected_specs(args)
    real = {line.strip() for line in gzip.open(REAL_NAMES, "rt") if not line.startswith("#")}
    assert set(specs) == {n for n in real if not n.startswith("model.layers.61.")}
    assert specs["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 56)
    assert specs["model.layers.3.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert specs["model.layers.3.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert specs["lm_head.weight"].dtype == torch.bfloat16
    norms = [n for n in specs if n.endswith(NORMS)]
    assert len(norms) == 61 * 6 + 1 and all(specs[n].dtype == torch.float32 for n in norms)


@pytest.mark.parametrize(
    "args",
    [TINY.replace(n_layers=5, n_mtp_layers=1), v3_layout(TINY.replace(n_layers=5, n_dense_layers=2, n_mtp_layers=1))],
    ids=["v3.2 with MTP", "v3 layout"],
)
def test_the_specs_from_the_first_moe_block_are_the_whole_models(args):
    """expected_specs builds the model to its first MoE block and repeats that block's tensors for
    the later ones: the same names, shapes, dtypes and order as the model built whole."""
    whole = built_specs(args)
    for mtp in (True, False):
        got = expected_specs(args, mtp=mtp)
        want = {n: s for n, s in whole.items() if mtp or not n.startswith(f"model.layers.{args.n_layers}.")}
        assert list(got.items()) == list(want.items())


def _exact(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values in a form torch.equal compares exactly across dtypes (FP8 by its codes)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.double()


@pytest.mark.parametrize(
    "args",
    [TINY, TINY.replace(scale_fmt=None), TINY.replace(dtype="bf16", scale_fmt=None)],
    ids=["fp8 ue8m0", "fp8 amax/448 scales", "bf16"],
)
def test_every_loaded_parameter_equals_its_checkpoint_tensor(tmp_path, args):
    """A checkpoint drawn at the full precision of each tensor's dtype (float32 norm gains, LayerNorm
    bias, router bias and, without ue8m0, block scales that are no powers of two) loads without
    rounding: each parameter holds exactly the file's values, as the reference's modules do."""
    source = SyntheticSource(args, seed=5)
    tensors = {name: source.load(name) for name in source.specs()}
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():  # the real layout's float32 norms, whatever the model declares
        if name.endswith(NORMS):
            tensors[name] = (name.endswith("weight") + 0.1 * torch.randn(t.shape, generator=gen)).float()
    full = [n for n, t in tensors.items() if t.dtype == torch.float32 and not (args.scale_fmt and "scale_inv" in n)]
    assert full and all(not torch.equal(tensors[n], tensors[n].bfloat16().float()) for n in full)  # not bf16 values
    if args.scale_fmt is None and args.dtype == "fp8":
        scales = torch.cat([t.flatten() for n, t in tensors.items() if n.endswith("weight_scale_inv")])
        assert not torch.equal(scales, torch.exp2(torch.log2(scales).round()))  # not powers of two
    model = load_model(save_checkpoint(tensors, args, tmp_path / "ckpt"))
    params = dict(model.named_parameters())
    assert sorted(to_hf(n) for n in params) == sorted(tensors)
    for name, param in params.items():
        want = tensors[to_hf(name)]
        assert param.dtype == want.dtype or (param.dtype, want.dtype) == (torch.float32, torch.bfloat16), name
        assert torch.equal(_exact(param.detach()), _exact(want)), name


def test_reading_specs_does_not_load_tensors(tiny_checkpoint):
    source = SafetensorsSource(tiny_checkpoint)
    assert len(source.specs()) == len(source.weight_map)
    assert source.args.has_gate_bias


def _copy(tiny_checkpoint, tmp_path) -> Path:
    target = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, target)
    return target


def _rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


SHARD1 = "model-00001-of-00002.safetensors"
SHARD2 = "model-00002-of-00002.safetensors"


def _missing_shard(d):
    (d / SHARD2).unlink()


def _truncated(d):
    data = (d / SHARD1).read_bytes()
    (d / SHARD1).write_bytes(data[: len(data) // 2])


def _wrong_shape(d):
    _rewrite(d / SHARD1, lambda t: t.update({"model.embed_tokens.weight": torch.zeros(10, 256, dtype=torch.bfloat16)}))


def _wrong_dtype(d):
    name = "model.layers.0.self_attn.q_a_proj.weight"
    _rewrite(d / SHARD1, lambda t: t.update({name: t[name].to(torch.bfloat16)}))


def _missing_tensor(d):
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    _rewrite(d / SHARD1, lambda t: t.pop(name))
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"][name]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _missing_config_field(d):
    config = json.loads((d / "config.json").read_text())
    del config["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(config))


def _no_config(d):
    (d / "config.json").unlink()


def _bad_index(d):
    (d / "model.safetensors.index.json").write_text("{not json")


def _not_safetensors(d):
    (d / SHARD2).write_bytes(b"\x00" * 64)


@pytest.mark.parametrize(
    "damage, message",
    [
        (_missing_shard, r"model-00002-of-00002\.safetensors: shard listed in .* is missing"),
        (_truncated, r"model-00001-of-00002\.safetensors: not a readable safetensors file"),
        (_wrong_shape, r"tensor model\.embed_tokens\.weight has shape \[10, 256\], expected \[512, 256\]"),
        (_wrong_dtype, r"model\.layers\.0\.self_attn\.q_a_proj\.weight has dtype BF16, expected F8_E4M3"),
        (_missing_tensor, r"tensor model\.layers\.0\.self_attn\.q_a_proj\.weight_scale_inv \(\[1, 2\] F32\) is missing"),
        (_missing_config_field, r"config\.json: missing field 'num_hidden_layers'"),
        (_no_config, r"config\.json: no such config file"),
        (_bad_index, r"model\.safetensors\.index\.json: not a valid index"),
        (_not_safetensors, r"model-00002-of-00002\.safetensors: not a readable safetensors file"),
    ],
)
def test_bad_checkpoints_fail_with_a_clear_message(tiny_checkpoint, tmp_path, damage, message):
    directory = _copy(tiny_checkpoint, tmp_path)
    damage(directory)
    with pytest.raises(CheckpointError, match=message):
        load_model(directory)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        load_model(tmp_path / "nowhere")


def test_mtp_layer_is_skipped(tiny_checkpoint, tmp_path, tokens):
    directory = _copy(tiny_checkpoint, tmp_path)
    extra = {"model.layers.3.eh_proj.weight": torch.zeros(256, 512, dtype=torch.bfloat16)}
    save_file(extra, str(directory / "mtp.safetensors"))
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(extra, "mtp.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    model = load_model(directory)
    # a stray tensor of layer n_layers in a config without an MTP module: neither an error nor a module
    assert len(model.mtp) == 0
    with torch.inference_mode():
        assert torch.equal(model(tokens), load_model(tiny_checkpoint)(tokens))
