"""Hostile and unusual trace files: a small file cannot claim unbounded work, every index a reader
uses is checked on load, and --record's defaults and ``tokens`` work on any model."""

import json
import re
import time

import pytest
import torch
from safetensors.torch import save_file

import tracing.tables.frames  # noqa: F401  (imported here, so the timings below are the trace's own)
from model import TINY
from model.config import MAX_EXPERT_MODULES, MAX_LAYERS
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.runner import trace_tokens
from tracing.sites import LOGIT_LENS, estimate_bytes, select
from tracing.trace import Trace, TraceError

IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61]  # T=10 > index_topk=8: the first queries select -1 keys
MAX_EXPERTS = MAX_EXPERT_MODULES // 4  # a model at the limits: one MoE block of this many experts


@pytest.fixture(scope="module")
def trace(tiny_model):
    return trace_tokens(tiny_model, IDS, prompt="p", record=["default", LOGIT_LENS])


def write(path, trace, tensors=None, config=None, **meta):
    """A trace file as a foreign writer could make it: the tiny trace's metadata with ``config``
    merged into its config (or, as a string, replacing it) and ``meta`` replacing entries."""
    metadata = trace.metadata()
    if isinstance(config, str):
        metadata["config"] = config
    elif config is not None:
        metadata["config"] = json.dumps({**json.loads(metadata["config"]), **config})
    metadata.update(meta)
    tensors = trace.tensors if tensors is None else tensors
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path), metadata=metadata)
    return path


def export(capsys, path, out):
    """``python -m tracing export``: status, stderr lines, CPU seconds."""
    start = time.process_time()
    code = main(["export", str(path), "--csv", str(out)])
    seconds = time.process_time() - start
    return code, capsys.readouterr().err.strip().splitlines(), seconds


def tokens_only(trace):
    return {"tokens": trace["tokens"]}


@pytest.mark.parametrize(
    "config, size",
    [
        ({"n_layers": 2_000_000}, "n_layers must be at most"),
        ({"n_routed_experts": 262_144}, "routed experts in all"),
        ({"n_layers": 2_000_000, "n_dense_layers": 1_999_999}, "n_layers must be at most"),
        ({"n_layers": MAX_LAYERS + 1, "n_dense_layers": MAX_LAYERS}, "blocks in all"),
    ],
)
def test_a_small_file_claiming_a_huge_model_is_refused_at_once(capsys, tmp_path, trace, config, size):
    """A 1 KB file of token ids whose config claims two million blocks or 262,144 experts: one line,
    status 2, before any work that grows with the claim (the claim alone would cost minutes and gigabytes)."""
    path = write(tmp_path / "t.safetensors", trace, tokens_only(trace), config)
    assert path.stat().st_size < 2048
    code, lines, seconds = export(capsys, path, tmp_path / "csv")
    assert code == 2 and len(lines) == 1, lines
    assert re.fullmatch(rf"error: .*t\.safetensors: bad metadata \(.*{size}.*\)", lines[0]), lines[0]
    assert seconds < 2 and not (tmp_path / "csv").exists()


def test_a_consistent_file_of_a_model_at_the_limits_costs_what_the_file_holds(capsys, tmp_path, trace):
    """A config at the limits a trace may claim (model.config: MAX_LAYERS blocks, the last one MoE, of
    a quarter of MAX_EXPERT_MODULES experts), with the
    last block's router recorded: validation and export read the sites the file holds, never every
    block or expert of the config; a site past the last block is refused."""
    config = {"n_layers": MAX_LAYERS, "n_dense_layers": MAX_LAYERS - 1, "n_routed_experts": MAX_EXPERTS}
    n, last = len(IDS), MAX_LAYERS - 1
    scores = torch.rand(n, MAX_EXPERTS, generator=torch.Generator().manual_seed(0))
    chosen = scores.topk(TINY.n_activated_experts, dim=-1).indices
    tensors = {
        "tokens": trace["tokens"],
        f"layers.{last}.ffn.gate.scores": scores,
        f"layers.{last}.ffn.gate.topk_indices": chosen,
        f"layers.{last - 1}.resid_post": trace["layers.0.resid_post"],
    }
    path = write(tmp_path / "t.safetensors", trace, tensors, config)
    code, lines, seconds = export(capsys, path, tmp_path / "csv")
    assert code == 0 and not lines and seconds < 2
    loaded = Trace.load(path)
    assert loaded.layers_with("ffn.gate.topk_indices") == [last] and loaded.layers_with("resid_post") == [last - 1]
    router = tracing.tables.frames.router_table(loaded)
    assert len(router) == n * MAX_EXPERTS and router["selected"].sum() == n * TINY.n_activated_experts
    beyond = write(
        tmp_path / "b.safetensors",
        trace,
        tensors | {f"layers.{MAX_LAYERS}.resid_post": trace["layers.0.resid_post"].clone()},
        config,
    )
    with pytest.raises(
        TraceError, match=rf"'layers\.{MAX_LAYERS}\.resid_post' is not a trace site of this model \(it has {MAX_LAYERS} blocks\)"
    ):
        Trace.load(beyond)


def _set(trace, name, row, col, value):
    out = dict(trace.tensors)
    out[name] = trace[name].clone()
    out[name][row, col] = value
    return out


T = len(IDS)
BAD_VALUES = [
    ("layers.1.ffn.gate.topk_indices", (0, 0), 999, r"holds 999, outside 0\.\.15"),
    ("layers.2.ffn.gate.topk_indices", (3, 1), -5, r"holds -5, outside 0\.\.15"),
    ("layers.2.ffn.gate.topk_indices", (0, 0), -1, r"holds -1, outside 0\.\.15"),  # -1 means none only for keys
    ("layers.0.attn.indexer.topk_indices", (9, 0), 1_000_000, rf"holds 1000000, outside -1\.\.{T - 1}"),
    ("layers.1.attn.indexer.topk_indices", (9, 2), -2, rf"holds -2, outside -1\.\.{T - 1}"),
    ("layers.1.attn.indexer.topk_indices", (9, 2), T, rf"holds {T}, outside -1\.\.{T - 1}"),
    ("layers.1.ffn.gate.groups", (0, 0), 4, r"holds 4, outside 0\.\.3"),
    ("layers.2.ffn.gate.groups", (0, 1), -1, r"holds -1, outside 0\.\.3"),
    ("layers.0.logit_lens.topk_indices", (0, 0), 512, r"holds 512, outside 0\.\.511"),
]


@pytest.mark.parametrize("name, where, value, message", BAD_VALUES)
def test_indices_outside_their_axis_are_refused_on_load(capsys, tmp_path, trace, name, where, value, message):
    """Shapes and dtypes right, values not: each reader would index an axis out of its range."""
    path = write(tmp_path / "t.safetensors", trace, _set(trace, name, *where, value))
    with pytest.raises(TraceError, match=re.escape(repr(name)) + " " + message):
        Trace.load(path)
    code, lines, _ = export(capsys, path, tmp_path / "csv")
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and name in lines[0], lines
    assert not (tmp_path / "csv").exists()


@pytest.mark.parametrize("value", [512, -1, 2**40])
def test_token_ids_outside_the_vocabulary_are_refused(capsys, tmp_path, trace, value):
    ids = trace["tokens"].clone()
    ids[4] = value
    path = write(tmp_path / "t.safetensors", trace, dict(trace.tensors) | {"tokens": ids})
    code, lines, _ = export(capsys, path, tmp_path / "csv")
    assert code == 2 and len(lines) == 1, lines
    assert f"tensor 'tokens' holds {value}, outside 0..511" in lines[0]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"config": "[" * 100_000}, r"bad metadata \(JSON nested too deeply\)"),
        ({"extra": json.dumps({"vocab": ["a", "b"]})}, "'vocab' is not a map of token ids to strings"),
        ({"extra": json.dumps({"vocab": {"5": {"x": 1}}})}, "'vocab' is not a map of token ids to strings"),
    ],
)
def test_metadata_the_readers_use_is_checked_on_load(capsys, tmp_path, trace, change, message):
    """A config nested past the parser's depth, and token strings (``extra['vocab']``, which the
    next-token and logit-lens tables read) that are not a map of strings."""
    path = write(tmp_path / "t.safetensors", trace, **change)
    with pytest.raises(TraceError, match=message):
        Trace.from_bytes(path.read_bytes(), "upload.safetensors")
    code, lines, _ = export(capsys, path, tmp_path / "csv")
    assert code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
    assert not (tmp_path / "csv").exists()


def test_default_record_on_a_model_without_a_moe_block(capsys, tmp_path):
    """The default patterns name the gate's sites; a model of dense blocks only has none, and the
    default still records what it has. A pattern the user gives must still match."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY.to_hf()))
    out = tmp_path / "t.safetensors"
    code = main(["run", "--synthetic", str(config), "--n-layers", "1", "--token-ids", "1,2,3", "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    saved = Trace.load(out)
    assert saved.config.n_layers == 1 and saved.config.n_moe_layers == 0
    assert "layers.0.resid_post" in saved and "logits.last" in saved
    assert not [n for n in saved.tensors if ".ffn.gate." in n]
    assert select(TINY.replace(n_layers=1), None) == select(TINY.replace(n_layers=1), "default")
    with pytest.raises(InputError, match="'layers.*.ffn.gate.*' matches no trace site"):
        select(TINY.replace(n_layers=1), "layers.*.ffn.gate.*")


def test_record_tokens_is_a_site_of_every_trace(tiny_model):
    assert select(TINY, "tokens") == [] and estimate_bytes(TINY, select(TINY, "tokens"), 3) == 3 * 8
    assert select(TINY, "tokens,layers.0.resid_post") == ["layers.0.resid_post"]
    only = trace_tokens(tiny_model, IDS[:3], record="tokens")
    assert list(only.tensors) == ["tokens"] and only.token_ids == IDS[:3]
    Trace.from_bytes(only.to_bytes())
    with pytest.raises(InputError, match="'token' matches no trace site"):
        select(TINY, "token")
