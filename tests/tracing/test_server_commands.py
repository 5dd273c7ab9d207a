"""Every command that traces writes through a model server what it writes on a model loaded here
(`patching --server`, `run --server --attribute --causal N`, prompt sets), and the ones that cannot run on a
server say why in one line. The server is the in-process one of tests/tracing/serving.py, listening
on a loopback port, so the command line reaches it as it reaches `python -m tracing serve`."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from tests.tracing.serving import listening
from tracing.analyses.graph import Graph
from tracing.cli.commands import main
from tracing.cli.loading import REPO
from tracing.client import Client
from tracing.sites import select
from tracing.trace import Trace

CLEAN, CORRUPT = "The cat sat on the mat", "The dog sat on the mat"  # one token differs
PROMPT = "It is a truth universally acknowledged"


SERVED: dict = {}  # the server's state, for a test that gives it dictionaries for a while


@pytest.fixture(scope="module")
def server(app_checkpoint):
    with listening(app_checkpoint) as (url, state, _):
        SERVED["state"] = state
        yield url


def test_patching_on_a_server_writes_the_local_table(server, app_checkpoint, tmp_path, capsys):
    argv = ["patching", "--clean", CLEAN, "--corrupt", CORRUPT, "--sites", "heads,experts", "--positions", "last"]
    argv += ["--target", " mat"]  # text, read by the server's tokenizer as by the local one
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--server", server, "--out", str(tmp_path / "remote")]) == 0
    capsys.readouterr()
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert (remote / "patching.csv").read_bytes() == (local / "patching.csv").read_bytes()
    a, b = (json.loads((d / "summary.json").read_text()) for d in (local, remote))
    assert {**a, "seconds": 0} == {**b, "seconds": 0} and a["runs"] > 10
    assert main([*argv[:-2], "--target", "no such token", "--server", server, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--target 'no such token' is" in err and "\n" not in err and not (tmp_path / "x").exists()


def test_gradient_patching_on_a_server_writes_the_local_table(server, app_checkpoint, tmp_path, capsys):
    argv = ["patching", "--clean", CLEAN, "--corrupt", CORRUPT, "--method", "gradient", "--sites", "heads,experts"]
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--server", server, "--out", str(tmp_path / "remote")]) == 0
    assert capsys.readouterr().err.count("patching (gradient)") == 2
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert (remote / "patching.csv").read_bytes() == (local / "patching.csv").read_bytes()
    assert json.loads((remote / "summary.json").read_text())["cells"] > 20


def test_run_causal_on_a_server_writes_the_local_trace_and_table(server, app_checkpoint, tmp_path, capsys):
    argv = ["run", "--prompt", PROMPT, "--attribute", "--causal", "3"]
    local, remote = tmp_path / "local", tmp_path / "remote"
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "l.safetensors"), "--csv", str(local)]) == 0
    assert main([*argv, "--server", server, "--out", str(tmp_path / "r.safetensors"), "--csv", str(remote)]) == 0
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()
    assert (remote / "causal.csv").read_bytes() == (local / "causal.csv").read_bytes()
    assert capsys.readouterr().err.count("causal check: 3 parts removed") == 2


def test_prompt_sets_on_a_server_give_the_local_means(server, app_checkpoint, tmp_path, capsys):
    pairs, prompts = tmp_path / "pairs.csv", tmp_path / "prompts.txt"
    pairs.write_text(f"clean,corrupt\n{CLEAN},{CORRUPT}\nIt is a truth,It is a fact\n", encoding="utf-8")
    prompts.write_text(f"{PROMPT}\n{CLEAN}\n", encoding="utf-8")
    argv = ["patching", "--pairs", str(pairs), "--sites", "resid_pre", "--positions", "last"]
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--server", server, "--out", str(tmp_path / "remote")]) == 0
    for name in ("patching_mean.csv", "patching_pairs.csv", "summary.json"):
        remote, local = ((tmp_path / d / name).read_bytes() for d in ("remote", "local"))
        assert remote == local or name == "summary.json"  # its seconds differ
    mean, each = (pd.read_csv(tmp_path / "local" / f"patching_{t}.csv") for t in ("mean", "pairs"))
    assert len(mean) == len(each) / 2 and set(each["line"]) == {2, 3} and (mean["n"] == 2).all()
    capsys.readouterr()
    lines = []
    for source in (["--checkpoint", app_checkpoint], ["--server", server]):
        assert main(["eval", *source, "--prompts", str(prompts), "--index-topk", "3"]) == 0
        lines.append({**json.loads(capsys.readouterr().out), "seconds": 0})
    assert lines[0] == lines[1] and lines[0]["difference_past_topk"]["n"] == 2


def test_run_graph_on_a_server_writes_the_local_trace(server, app_checkpoint, tmp_path):
    """docs/examples/steering.json (its direction in the safetensors file beside it) from the command
    line here and through the server, and from Python's client: one trace, to the byte."""
    graph = REPO / "docs" / "examples" / "steering.json"
    argv = ["run", "--prompt", PROMPT, "--generate", "2", "--graph", str(graph)]
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "l.safetensors")]) == 0
    assert main([*argv, "--server", server, "--out", str(tmp_path / "r.safetensors")]) == 0
    local = (tmp_path / "l.safetensors").read_bytes()
    assert (tmp_path / "r.safetensors").read_bytes() == local
    with Client(server) as client:
        assert client.trace(prompt=PROMPT, generate=2, graph=Graph.load(graph)).to_bytes() == local
    assert Trace.load(tmp_path / "l.safetensors").extra["graph"]["tensors"]["direction"]["sha256"]


def test_run_with_a_dictionary_on_a_server_writes_the_local_trace(server, app_checkpoint, tmp_path):
    """run --dictionary NAME --feature ... through the server (its own dictionary, by name) writes the
    trace run --dictionary DIR writes here, to the byte."""
    import torch

    from tracing.dictionary import Dictionary, save
    from tracing.dictionary.features import load_catalogue

    state = SERVED["state"]
    d = Dictionary("sae", "layers.1.resid_post", state.model.loaded.model.args.dim, 32, 4)
    save(d.init_weights(torch.Generator().manual_seed(1)), tmp_path / "dicts" / "resid")
    argv = ["run", "--prompt", PROMPT, "--feature", "layers.1.resid_post:5*0@3:"]
    local = ["--checkpoint", app_checkpoint, "--dictionary", str(tmp_path / "dicts" / "resid")]
    assert main([*argv, *local, "--out", str(tmp_path / "l.safetensors")]) == 0
    state.model.dictionaries = load_catalogue(tmp_path / "dicts", state.model.loaded.model.args)
    try:
        assert main([*argv, "--server", server, "--dictionary", "resid", "--out", str(tmp_path / "r.safetensors")]) == 0
    finally:
        state.model.dictionaries = {}
    assert (tmp_path / "r.safetensors").read_bytes() == (tmp_path / "l.safetensors").read_bytes()
    assert "layers.1.resid_post.features.top_ids" in Trace.load(tmp_path / "l.safetensors").tensors


@pytest.mark.parametrize(
    "argv, words",
    [
        (["eval", "--checkpoint", "demo", "--text-file", "t.txt"], "--max-prompt-tokens"),
        (["atlas", "--out", "atlas"], "batches of a corpus"),
        (["diff", "a.safetensors", "b.safetensors"], "a server holds one model, and diff compares two"),
        (["patching", "--clean-ids", "1,2", "--corrupt-ids", "1,3", "--out", "p", "--stream"], "--stream: the server's model"),
    ],
)
def test_a_command_that_cannot_use_the_server_says_why_in_one_line(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--server", "http://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and not list(tmp_path.iterdir())


def test_what_a_run_records_reads_back_with_the_sites_read_together(app_checkpoint, tmp_path):
    """A site recorded alone brings the rest of its group, so the file a run writes is one Trace.load reads."""
    out = tmp_path / "t.safetensors"
    argv = ["run", "--checkpoint", app_checkpoint, "--prompt", PROMPT, "--record", "next.topk_indices", "--out", str(out)]
    assert main(argv) == 0
    trace = Trace.load(out)
    assert set(trace.tensors) == {"tokens", "next.topk_indices", "next.topk_probs"}
    assert select(trace.config, "layers.1.attn.attribution") == ["layers.1.attn.attribution", "layers.1.ffn.attribution"]


@pytest.mark.slow
def test_dictionary_training_on_a_server_matches_the_local_one(server, app_checkpoint, tmp_path, capsys):
    sample = REPO / "assets" / "demo" / "heldout_sample.txt"
    if not sample.is_file():
        pytest.skip("assets/demo is not there")
    argv = ["dictionary", "train", "--text-file", str(sample), "--site", "layers.1.resid_post", "--features", "32"]
    argv += ["--k", "4", "--seq-len", "64", "--batch-size", "2", "--rows-per-step", "48", "--max-tokens", "640"]
    argv += ["--heldout", "0.25"]
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(tmp_path / "local")]) == 0
    assert main([*argv, "--server", server, "--tokenizer", app_checkpoint, "--out", str(tmp_path / "remote")]) == 0
    capsys.readouterr()
    local, remote = (json.loads((tmp_path / d / "report.json").read_text()) for d in ("local", "remote"))
    assert remote["steps"] == local["steps"] and remote["heldout_rows"] == local["heldout_rows"]
    assert remote["clean_loss"] == pytest.approx(local["clean_loss"], rel=1e-3)
    assert remote["variance_explained"] == pytest.approx(local["variance_explained"], abs=0.05)
    assert remote["spliced_loss"] == pytest.approx(local["spliced_loss"], rel=0.05)
    argv[argv.index("layers.1.resid_post")] = "layers.1.ffn"
    assert main([*argv, "--server", server, "--tokenizer", app_checkpoint, "--out", str(tmp_path / "t")]) == 2
    assert "a server does not record" in capsys.readouterr().err
