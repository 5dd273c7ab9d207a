"""Unusual checkpoints and hostile configs or prompts: the same traces, or one clear line and exit status 2."""

import json
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from model import TINY
from model.config import ConfigError, ModelArgs
from tracing.cli.commands import main
from tracing.cli.loading import resolve_checkpoint
from tracing.tokenizer import Tokenizer, TokenizerError

IDS = "1,2,3,4,5,6,7,8,9,10,11,12"


@pytest.fixture(scope="module")
def single_file_checkpoint(tmp_path_factory, tiny_source):
    """The tensors of ``tiny_checkpoint`` in one model.safetensors, without an index."""
    directory = tmp_path_factory.mktemp("single") / "ckpt"
    directory.mkdir()
    save_file(
        {n: tiny_source.load(n).contiguous() for n in tiny_source.specs()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (directory / "config.json").write_text(json.dumps(TINY.to_hf(), indent=2) + "\n")
    return directory


def bad_input(capsys, *argv) -> str:
    """The one stderr line of a command that must refuse its input."""
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("stream", [False, True], ids=["loaded", "streamed"])
def test_single_file_checkpoint_traces_like_the_sharded_one(
    capsys, tiny_checkpoint, single_file_checkpoint, tmp_path, monkeypatch, stream
):
    # both under the same relative name: the trace records the checkpoint as given
    (tmp_path / "sharded").mkdir()
    (tmp_path / "sharded" / "ckpt").symlink_to(tiny_checkpoint)
    (tmp_path / "single").mkdir()
    (tmp_path / "single" / "ckpt").symlink_to(single_file_checkpoint)
    traces = {}
    for layout in ("sharded", "single"):
        monkeypatch.chdir(tmp_path / layout)
        argv = ["run", "--checkpoint", "ckpt", "--token-ids", IDS, "--out", "t.safetensors", *(["--stream"] if stream else [])]
        assert main(argv) == 0, capsys.readouterr().err
        traces[layout] = (tmp_path / layout / "t.safetensors").read_bytes()
    assert traces["single"] == traces["sharded"]


def test_info_reads_a_single_file_checkpoint(capsys, tiny_checkpoint, single_file_checkpoint):
    outputs = []
    for directory in (tiny_checkpoint, single_file_checkpoint):
        assert main(["info", "--checkpoint", str(directory), "--tensors"]) == 0
        outputs.append(json.loads(capsys.readouterr().out))
    assert outputs[0] == outputs[1] and outputs[1]["n_layers"] == TINY.n_layers


def test_unreadable_single_file_is_named(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf()))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)
    err = bad_input(capsys, "info", "--checkpoint", str(tmp_path))
    assert "model.safetensors: not a readable safetensors file" in err


def _hf(**changes) -> dict:
    data = TINY.to_hf()
    for key, value in changes.items():
        if key.startswith("rope_scaling."):
            data["rope_scaling"] = {**data["rope_scaling"], key.split(".", 1)[1]: value}
        else:
            data[key] = value
    return data


def _write(tmp_path, data) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes and reads them
    return str(path)


# Sizes the committed checks let through (others, like dim, were refused already).
@pytest.mark.parametrize(
    "key, value, field",
    [
        ("intermediate_size", -384, "inter_dim"),
        ("moe_intermediate_size", 0, "moe_inter_dim"),
        ("kv_lora_rank", -1, "kv_lora_rank"),
        ("qk_nope_head_dim", 0, "qk_nope_head_dim"),
        ("qk_rope_head_dim", -64, "qk_rope_head_dim"),
        ("v_head_dim", -32, "v_head_dim"),
        ("n_routed_experts", -16, "n_routed_experts"),
        ("num_experts_per_tok", 0, "n_activated_experts"),
        ("first_k_dense_replace", -1, "n_dense_layers"),
        ("n_shared_experts", -1, "n_shared_experts"),
        ("rope_scaling.original_max_position_embeddings", -4096, "original_seq_len"),
        ("rope_scaling.beta_fast", 0, "beta_fast"),
    ],
)
def test_non_positive_sizes_are_refused(capsys, tmp_path, key, value, field):
    err = bad_input(capsys, "info", "--config", _write(tmp_path, _hf(**{key: value})))
    assert f"{field} must" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("rms_norm_eps", float("nan"), "norm_eps"),
        ("rms_norm_eps", -1, "norm_eps"),
        ("rope_theta", float("nan"), "rope_theta"),
        ("rope_theta", 0, "rope_theta"),
        ("rope_theta", float("inf"), "rope_theta"),
        ("rope_scaling.factor", 0, "rope_factor"),
        ("rope_scaling.factor", float("nan"), "rope_factor"),
        ("routed_scaling_factor", float("nan"), "route_scale"),
        ("rope_scaling.mscale_all_dim", float("inf"), "mscale"),
    ],
)
def test_non_finite_or_non_positive_floats_are_refused(capsys, tmp_path, key, value, field):
    err = bad_input(capsys, "info", "--config", _write(tmp_path, _hf(**{key: value})))
    assert f"{field} must" in err


@pytest.mark.parametrize(
    "data, words",
    [
        (_hf(max_position_embeddings="big"), "max_seq_len must be an integer, not 'big'"),
        (_hf(max_position_embeddings=None), "max_seq_len must be an integer"),
        (_hf(quantization_config="fp8"), "quantization_config must be an object"),
        (_hf(rope_scaling="yarn"), "rope_scaling must be an object"),
        (_hf(quantization_config={"weight_block_size": 128}), "weight_block_size 128"),
        (_hf(routed_scaling_factor=True), "route_scale must be a number"),
        ({**TINY.to_reference(), "gate_bias": "yes"}, "gate_bias must be true, false or null"),
    ],
    ids=["string-int", "null-int", "string-quant", "string-rope", "int-block", "bool-float", "string-bool"],
)
def test_wrong_json_types_are_refused(capsys, tmp_path, data, words):
    err = bad_input(capsys, "info", "--config", _write(tmp_path, data))
    assert words in err


@pytest.mark.parametrize("data", [[1, 2], "config", 3, None])
def test_a_config_that_is_not_an_object(capsys, tmp_path, data):
    for read in (ModelArgs.from_hf, ModelArgs.from_reference, ModelArgs.from_json):
        with pytest.raises(ConfigError, match="must be a JSON object"):
            read(data)
    err = bad_input(capsys, "info", "--config", _write(tmp_path, data))
    assert "must be a JSON object" in err


def test_config_messages_name_the_file_once(capsys, tmp_path, tiny_checkpoint):
    data = TINY.to_hf()
    del data["num_hidden_layers"]
    path = _write(tmp_path, data)
    err = bad_input(capsys, "info", "--config", path)
    assert err == f"error: {path}: missing field 'num_hidden_layers'\n"
    err = bad_input(capsys, "info", "--config", _write(tmp_path, _hf(hidden_size=-1)))
    assert err == f"error: {path}: dim must be positive, not -1\n"
    err = bad_input(capsys, "run", "--synthetic", path, "--token-ids", "1", "--out", str(tmp_path / "o.safetensors"))
    assert err.count("config.json") == 1
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(_hf(rope_scaling={"type": "linear"})))
    save_file({}, str(directory / "model.safetensors"))
    err = bad_input(capsys, "run", "--checkpoint", str(directory), "--token-ids", "1", "--out", str(tmp_path / "o.safetensors"))
    assert err == f"error: {directory / 'config.json'}: rope_scaling type 'linear' is not supported (yarn only)\n"
    assert not (tmp_path / "o.safetensors").exists()


def test_a_prompt_that_is_not_utf8_is_refused(app_checkpoint, tmp_path):
    out = tmp_path / "x.safetensors"
    argv = [sys.executable, "-m", "tracing", "run", "--checkpoint", app_checkpoint, "--prompt", b"ab\xff\xfe", "--out", out]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == "error: the prompt is not valid UTF-8 (byte 0xff at character 2)\n"
    assert not out.exists()
    tokenizer = Tokenizer(resolve_checkpoint(app_checkpoint))
    with pytest.raises(TokenizerError, match="U\\+D800"):
        tokenizer.encode("a\ud800")  # a lone surrogate from a string, not from bytes
