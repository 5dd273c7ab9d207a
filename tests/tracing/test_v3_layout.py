"""Every command on a checkpoint in DeepSeek-V3's layout (no lightning indexer): the traces hold no
indexer site, an explicit indexer pattern is refused in one line, and the server answers as ``run``."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from starlette.testclient import TestClient

from model.checkpoint import SafetensorsSource
from tests.devcheckpoint import make_dev_checkpoint
from tracing.cli.commands import main
from tracing.cli.loading import open_checkpoint
from tracing.client import read_answer
from tracing.runner import TraceRequest, run
from tracing.server.http import State, make_app
from tracing.server.wire import Limits, encode_request
from tracing.server.worker import Model, Queue, lead
from tracing.sites import INDEXER_MISSING
from tracing.trace import Trace

PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("v3") / "checkpoint"
    make_dev_checkpoint(directory, v3=True)
    return str(directory)


def cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def traced(capsys, checkpoint, path, *flags) -> Trace:
    code, _, err = cli(capsys, "run", "--checkpoint", checkpoint, "--prompt", PROMPT, "--out", path, *flags)
    assert code == 0, err
    return Trace.load(path)


def no_indexer(trace: Trace) -> None:
    assert not trace.config.has_indexer
    assert not [name for name in trace.tensors if ".indexer." in name or "attribution_dropped" in name]


def test_run_and_its_modes_record_no_indexer_site(capsys, v3_checkpoint, tmp_path):
    plain = traced(capsys, v3_checkpoint, tmp_path / "t.safetensors", "--csv", tmp_path / "tables")
    no_indexer(plain)
    assert "layers.1.ffn.gate.topk_indices" in plain.tensors and "layers.0.attn.probs_mean" in plain.tensors
    written = {p.name for p in (tmp_path / "tables").iterdir()}
    assert {"residual.csv", "router.csv", "next_token.csv"} <= written and "indexer_recall.csv" not in written
    for flags in (("--generate", 3), ("--prefill", 3), ("--attribute", "--record", "default,flow"), ("--record", "all")):
        trace = traced(capsys, v3_checkpoint, tmp_path / "m.safetensors", *flags)
        no_indexer(trace)
        trace.tables()  # every table builds without the indexer's sites


def test_every_positions_next_token_is_formed_as_the_models_own_head_forms_it(capsys, v3_checkpoint, tmp_path):
    """V3's head is a bfloat16 product: next.* at the earlier positions (the tracer's head call) equal
    the distribution of the logits the model itself forms at every position (logits.all)."""
    from tracing.sites import next_topk

    own = traced(capsys, v3_checkpoint, tmp_path / "all.safetensors", "--record", "logits.all")
    trace = traced(capsys, v3_checkpoint, tmp_path / "n.safetensors", "--record", "next.topk_indices,next.topk_probs")
    indices, probs = next_topk(own["logits.all"].float())  # (T, V): the model's head at every position
    assert torch.equal(trace["next.topk_indices"], indices) and torch.equal(trace["next.topk_probs"], probs)


def test_attribution_reads_every_causal_key(capsys, v3_checkpoint, tmp_path):
    trace = traced(capsys, v3_checkpoint, tmp_path / "a.safetensors", "--attribute", "--record", "default,flow")
    no_indexer(trace)
    n = len(trace.tokens)
    flow = trace["layers.0.attn.flow"]  # (T, S): the share each earlier position brought
    assert flow.shape == (n, n) and (flow.triu(1) == 0).all() and (flow.tril() > 0).any()
    for i in range(trace.config.n_layers):  # each head read every key; its sources add up to its part
        sources, rest, heads = (
            trace[f"layers.{i}.attn.{s}"].double() for s in ("attribution_src", "attribution_src_rest", "attribution")
        )
        assert sources.shape[-1] == n and (sources != 0).all()
        assert torch.allclose(sources.sum(-1) + rest, heads, atol=1e-5)
    assert len(trace.tables()["attribution"])


def test_streaming_writes_the_same_trace(capsys, v3_checkpoint, tmp_path):
    whole = tmp_path / "whole.safetensors"
    streamed = tmp_path / "streamed.safetensors"
    traced(capsys, v3_checkpoint, whole, "--generate", 2)
    traced(capsys, v3_checkpoint, streamed, "--generate", 2, "--stream")
    got = Trace.load(streamed)
    assert got.extra.pop("stream")["disk_bytes"] > 0  # where its weights came from: the rest is the same bytes
    assert whole.read_bytes() == got.to_bytes()


def test_an_indexer_pattern_is_refused_in_one_line(capsys, v3_checkpoint, tmp_path):
    code, out, err = cli(
        capsys,
        "run",
        "--checkpoint",
        v3_checkpoint,
        "--prompt",
        PROMPT,
        "--record",
        "layers.*.attn.indexer.*",
        "--out",
        tmp_path / "x",
    )
    assert code == 2 and not out and len(err.strip().splitlines()) == 1 and INDEXER_MISSING in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "flags, says",
    [
        (("--dense-attention",), INDEXER_MISSING),
        (("--index-topk", "2"), INDEXER_MISSING),
        (("--no-act-fp8",), "does not round its activations"),
    ],
)
def test_interventions_on_the_indexer_or_the_rounding_are_refused(capsys, v3_checkpoint, tmp_path, flags, says):
    out = tmp_path / "x.safetensors"
    code, printed, err = cli(capsys, "run", "--checkpoint", v3_checkpoint, "--prompt", PROMPT, *flags, "--out", out)
    assert code == 2 and not printed and len(err.strip().splitlines()) == 1 and says in err
    assert not out.exists()


def test_export_info_eval_and_diff(capsys, v3_checkpoint, tmp_path):
    a = tmp_path / "a.safetensors"
    b = tmp_path / "b.safetensors"
    traced(capsys, v3_checkpoint, a)
    traced(capsys, v3_checkpoint, b, "--prefill", 3)
    code, _, err = cli(capsys, "export", a, "--csv", tmp_path / "exported", "--parquet")
    assert code == 0, err
    assert (tmp_path / "exported" / "router.parquet").is_file() and (tmp_path / "exported" / "router.csv").is_file()
    code, out, _ = cli(capsys, "info", "--checkpoint", v3_checkpoint, "--tensors")
    info = json.loads(out)
    assert code == 0 and info["tensors"] and not [name for name in info["tensors"] if "indexer" in name]
    assert info["components"].get("indexer", 0) == 0 and info["index_topk"] is None
    (tmp_path / "text.txt").write_text(PROMPT + ", that a single man in possession of a good fortune")
    code, out, err = cli(capsys, "eval", "--checkpoint", v3_checkpoint, "--text-file", tmp_path / "text.txt")
    assert code == 0, err
    assert json.loads(out)["tokens"] > 5
    code, out, err = cli(capsys, "diff", a, b)
    assert code == 0, err
    assert "first_block_changed" in json.loads(out.splitlines()[0])


def test_the_server_answers_as_run(v3_checkpoint):
    loaded = open_checkpoint(v3_checkpoint)
    assert not SafetensorsSource(v3_checkpoint).args.has_indexer
    state = State(Limits(max_prompt_tokens=64, max_generate=8, max_body_bytes=1 << 20, max_queue=2), Queue(2), "t" * 32)
    stopping = threading.Event()
    model = Model(loaded)
    worker = threading.Thread(target=lead, args=(model, state.jobs, stopping, 0.2), daemon=True)
    worker.start()
    state.model, state.facts = model, {"health": {"model": loaded.label}, "info": {"model": loaded.label}}
    request = TraceRequest(prompt=PROMPT, generate=2, attribute=True)
    try:
        with TestClient(make_app(state)) as client:
            client.headers["authorization"] = "Bearer " + "t" * 32
            body, kind = encode_request(request)
            answer = client.post("/trace", content=body, headers={"content-type": kind})
            assert answer.status_code == 200
            refused = client.post("/trace", json={"prompt": PROMPT, "record": ["layers.*.attn.indexer.scores"]})
            assert refused.status_code == 422 and INDEXER_MISSING in refused.text
    finally:
        stopping.set()
        worker.join(10)
    want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
    assert read_answer(iter([answer.content]), lambda event: None) == want.to_bytes()
    no_indexer(want)


def test_a_gradient_runs_through_v3s_arithmetic_and_leaves_its_forward(v3_checkpoint):
    """V3's attention reads the dequantised wkv_b a pass in inference mode kept: a constant of the backward."""
    loaded = open_checkpoint(v3_checkpoint)
    ids = [5, 17, 33, 2, 40, 9]
    plain = run(loaded.model, TraceRequest(token_ids=ids))
    taken = run(loaded.model, TraceRequest(token_ids=ids, gradient_of=(3, 4)))
    assert all(torch.equal(value, taken[name]) for name, value in plain.tensors.items())
    assert taken["layers.0.grad.resid_pre"].abs().sum() > 0
