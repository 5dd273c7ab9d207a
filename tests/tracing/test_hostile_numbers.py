"""Non-finite values: refused in patches, reported when a run produces them, never a future key."""

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import load_model, save_checkpoint
from tracing.cli.commands import main
from tracing.runner import trace_tokens
from tracing.trace import Trace

IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3]


def test_a_patch_with_nan_exits_2(capsys, tiny_checkpoint, tmp_path):
    patch = torch.zeros(3, 256)
    patch[1, 7] = float("nan")
    save_file({"layers.1.resid_pre": patch}, str(tmp_path / "patch.safetensors"))
    out = tmp_path / "t.safetensors"
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", "--out", str(out)]
    assert main([*argv, "--patch", str(tmp_path / "patch.safetensors")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "patch 'layers.1.resid_pre' holds NaN or infinite values" in err[0]
    assert not out.exists()


@pytest.fixture(scope="module")
def nan_checkpoint(tiny_source, tmp_path_factory):
    """The tiny checkpoint with one NaN in block 1's FFN norm gain."""
    tensors = {name: tiny_source.load(name) for name in tiny_source.specs()}
    tensors["model.layers.1.post_attention_layernorm.weight"][3] = float("nan")
    return save_checkpoint(tensors, tiny_source.args, tmp_path_factory.mktemp("nan") / "ckpt")


def test_a_run_that_turns_non_finite_says_where(capsys, nan_checkpoint, tmp_path):
    out = tmp_path / "t.safetensors"
    argv = ["run", "--checkpoint", str(nan_checkpoint), "--token-ids", ",".join(map(str, IDS)), "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "warning: non-finite values from layers.1.ffn.gate.scores at position 0 on" in err
    assert Trace.load(out).extra["nonfinite"] == {"site": "layers.1.ffn.gate.scores", "position": 0}


def test_a_finite_run_has_no_note(tiny_model):
    assert "nonfinite" not in trace_tokens(tiny_model, IDS).extra


def test_nan_index_scores_never_select_a_future_key(tiny_source):
    """NaN sorts above every score: a NaN row must not list keys the causal mask removed."""
    model = load_model(tiny_source)
    with torch.no_grad():
        model.layers[0].attn.indexer.k_norm.weight[5] = float("nan")
    trace = trace_tokens(model, IDS)
    assert trace.extra["nonfinite"]["site"] == "layers.0.attn.indexer.scores"
    for i in range(model.args.n_layers):
        selected = trace[f"layers.{i}.attn.indexer.topk_indices"]
        positions = torch.arange(len(IDS))[:, None]
        assert ((selected == -1) | ((selected >= 0) & (selected <= positions))).all(), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_a_non_finite_value_is_found_where_it_is_and_masks_are_not(bad, dtype):
    """NaN and +inf anywhere, -inf outside the masked score sites, at the first position that holds one."""
    from model import TINY
    from tracing.nonfinite import first_nonfinite

    scores = torch.randn(6, 6).tril().masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), float("-inf")).to(dtype)
    stream = torch.randn(6, TINY.dim).to(dtype)
    assert first_nonfinite({"layers.0.attn.indexer.scores": scores, "layers.0.resid_post": stream}, TINY, 6) is None
    for name, value in (("layers.0.attn.indexer.scores", scores.clone()), ("layers.0.resid_post", stream.clone())):
        value[4, 2] = float(bad)
        found = first_nonfinite({name: value}, TINY, 6)
        if bad == "-inf" and name.endswith("scores"):
            assert found is None
        else:
            assert found is not None and (found.site, found.position) == (name, 4)
