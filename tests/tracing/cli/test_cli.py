"""The command line: outputs, and exit status 2 with one clear line for each kind of bad input."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import save_checkpoint
from model.synthetic import SyntheticSource
from tests.devcheckpoint import train_tokenizer
from tracing.cli.commands import main
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[3]

REAL_HF = "assets/configs/config_671B_hf.json"


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tiny_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tok") / "tiny"
    shutil.copytree(tiny_checkpoint, directory)
    texts = ["the quick brown fox jumps over the lazy dog " * 20, "sparse attention picks keys"]
    train_tokenizer(directory, texts, 400, ["<bos>", "<eos>"])
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True})
    )
    return directory


def run(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_info_on_the_real_config(capsys):
    code, out, _ = run(capsys, "info", "--config", REAL_HF)
    info = json.loads(out)
    assert code == 0 and info["total_params"] == 671_877_944_064 and info["n_layers"] == 61
    assert 37.4e9 < info["activated_params"] < 37.6e9
    code, out, _ = run(capsys, "info", "--config", "assets/configs/config_671B_v3.2.json", "--tensors")
    tensors = json.loads(out)["tensors"]
    assert tensors["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == [[5, 56], "F32"]
    assert len(tensors) == 90854


def test_run_prompt_writes_trace_and_csv(capsys, checkpoint_with_tokenizer, tmp_path):
    out = tmp_path / "t.safetensors"
    code, _, err = run(
        capsys,
        "run",
        "--checkpoint",
        str(checkpoint_with_tokenizer),
        "--prompt",
        "the quick brown fox",
        "--out",
        str(out),
        "--csv",
        str(tmp_path / "csv"),
        "--dtype",
        "float32",
        "--record",
        "default,layers.*.logit_lens.*",
    )
    assert code == 0, err
    trace = Trace.load(out)
    assert (
        trace.prompt == "the quick brown fox"
        and trace.tokens[0] == "<bos>"
        and "".join(trace.tokens[1:]) == "the quick brown fox"
    )
    assert trace.extra["dtype"] == "float32"
    assert (tmp_path / "csv" / "router.csv").exists() and (tmp_path / "csv" / "logit_lens.csv").exists()
    code, _, err = run(capsys, "export", str(out), "--csv", str(tmp_path / "again"), "--parquet")
    assert code == 0 and (tmp_path / "again" / "indexer.parquet").exists()


def _patch_file(tmp_path, tensors):
    path = tmp_path / f"patch-{len(list(tmp_path.glob('patch-*')))}.safetensors"
    save_file(tensors, str(path))
    return str(path)


@pytest.mark.parametrize(
    "case",
    [
        "missing checkpoint",
        "malformed checkpoint",
        "empty prompt",
        "too long",
        "unknown token id",
        "bad token ids",
        "wrong patch shape",
        "unknown patch site",
        "bad record pattern",
        "prompt without tokenizer",
        "prefill of none",
        "prefill past the tokens",
        "prefill with a patch",
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_output(capsys, tiny_checkpoint, checkpoint_with_tokenizer, tmp_path, case):
    out = tmp_path / "out.safetensors"
    ckpt = str(checkpoint_with_tokenizer)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    (broken / "config.json").write_text("{")
    argv, message = {
        "missing checkpoint": (["--checkpoint", str(tmp_path / "nope"), "--token-ids", "1,2"], "not a checkpoint directory"),
        "malformed checkpoint": (["--checkpoint", str(broken), "--token-ids", "1,2"], "not a readable JSON config"),
        "empty prompt": (["--checkpoint", ckpt, "--prompt", "  "], "the prompt is empty"),
        "too long": (["--checkpoint", ckpt, "--token-ids", ",".join(["1"] * 16385)], "at most 16384"),
        "unknown token id": (["--checkpoint", ckpt, "--token-ids", "1,2,512"], "token id 512 is outside the vocabulary"),
        "bad token ids": (["--checkpoint", ckpt, "--token-ids", "1,x"], "comma-separated integers"),
        "wrong patch shape": (
            [
                "--checkpoint",
                ckpt,
                "--token-ids",
                "1,2,3",
                "--patch",
                _patch_file(tmp_path, {"layers.1.resid_pre": torch.zeros(4, 256)}),
            ],
            r"patch 'layers.1.resid_pre' has shape \[4, 256\], this run needs \[3, 256\]",
        ),
        "unknown patch site": (
            ["--checkpoint", ckpt, "--token-ids", "1,2,3", "--patch", _patch_file(tmp_path, {"layers.1.bogus": torch.zeros(3)})],
            "not a trace site",
        ),
        "bad record pattern": (
            ["--checkpoint", ckpt, "--token-ids", "1,2", "--record", "layers.*.nothing"],
            "matches no trace site",
        ),
        "prompt without tokenizer": (["--checkpoint", str(tiny_checkpoint), "--prompt", "hi"], "has no tokenizer.json"),
        "prefill of none": (["--checkpoint", ckpt, "--token-ids", "1,2,3", "--prefill", "0"], "--prefill 0: must be between"),
        "prefill past the tokens": (["--checkpoint", ckpt, "--token-ids", "1,2,3", "--prefill", "4"], "between 1 and 3"),
        "prefill with a patch": (
            [
                "--checkpoint",
                ckpt,
                "--token-ids",
                "1,2,3",
                "--prefill",
                "2",
                "--patch",
                _patch_file(tmp_path, {"layers.1.resid_pre": torch.zeros(3, 256)}),
            ],
            "cannot be combined with --prefill",
        ),
    }[case]
    code, _, err = run(capsys, "run", *argv, "--out", str(out), "--csv", str(tmp_path / "csv"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert re.search(message, lines[0]), lines[0]
    assert not out.exists() and not (tmp_path / "csv").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind


def test_unreadable_trace_file(capsys, tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 10)
    code, _, err = run(capsys, "export", str(tmp_path / "bad.safetensors"), "--csv", str(tmp_path / "c"))
    assert code == 2 and "not a readable trace file" in err and not (tmp_path / "c").exists()


def test_real_process_exit_status_and_no_traceback(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracing",
            "run",
            "--checkpoint",
            str(tmp_path),
            "--token-ids",
            "1",
            "--out",
            str(tmp_path / "o.safetensors"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "config.json" in proc.stderr


def without_stream_figures(path) -> bytes:
    """A streamed trace file's bytes without its ``stream`` metadata (where its weights came from)."""
    trace = Trace.load(path)
    assert set(trace.extra.pop("stream")) == {"disk_bytes", "host_bytes", "device_hit_bytes"}
    return trace.to_bytes()


def test_streaming_gives_the_same_trace_file(capsys, tiny_checkpoint, tmp_path):
    ids = "1,2,3,4,5,6,7,8,9,10,11,12"
    whole, streamed = tmp_path / "whole.safetensors", tmp_path / "streamed.safetensors"
    assert main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--out", str(whole)]) == 0
    assert main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--out", str(streamed), "--stream"]) == 0
    assert whole.read_bytes() == without_stream_figures(streamed)
    decoded, streamed = tmp_path / "decoded.safetensors", tmp_path / "decoded-streamed.safetensors"
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--prefill", "5", "--generate", "2"]
    assert main([*argv, "--out", str(decoded)]) == 0 and main([*argv, "--out", str(streamed), "--stream"]) == 0
    assert decoded.read_bytes() == without_stream_figures(streamed)  # decode steps run on what the tiers keep
    assert Trace.load(decoded).extra["prefill"] == 5 and Trace.load(decoded).extra["generation"]["generated"] == 2


@pytest.fixture(scope="module")
def split_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose every layer splits over 2 ranks (heads, MLPs, experts, vocabulary)."""
    from tests.model.test_parallel import TP_TINY

    source = SyntheticSource(TP_TINY, seed=4)
    directory = tmp_path_factory.mktemp("split") / "tp"
    return save_checkpoint({n: source.load(n) for n in source.specs()}, TP_TINY, directory)


ANALYSES = ["--attribute", "--record", "default,flow,layers.*.attn.attribution_src"]
TORCHRUN_CASES = {  # name: (flags, on the checkpoint split in every layer)
    "prefill": ([], False),
    "decode and generate": (["--prefill", "6", "--generate", "3"], False),
    "attribution and flow, heads split": (ANALYSES, True),
    "attribution, decode path, heads split": ([*ANALYSES, "--prefill", "8"], True),
}
TORCHRUN_IDS = "1,2,3,4,5,6,7,8,9,10,11,12"
# each case's command, one after another in the ranks torchrun started: one launch for all (each costs
# two interpreters importing torch), one process group for all (a group formed again on the same
# store may meet the last group's addresses), left once at the end
RUN_EACH = """
import json, sys
from tracing.cli import commands
leave, commands._leave_process_group = commands._leave_process_group, lambda: None
try:
    for argv in json.loads(sys.argv[1]):
        if code := commands.main(argv):
            sys.exit(code)
finally:
    leave()
"""


@pytest.fixture(scope="module")
def torchrun_traces(tiny_checkpoint, split_checkpoint, tmp_path_factory) -> dict[str, Path]:
    """Each case of TORCHRUN_CASES run by ``python -m tracing run`` on two ranks (gloo) under torchrun."""
    import socket

    out = tmp_path_factory.mktemp("torchrun")
    traces, commands = {}, []
    for i, (name, (more, split)) in enumerate(TORCHRUN_CASES.items()):
        traces[name] = out / f"{i}.safetensors"
        checkpoint = split_checkpoint if split else tiny_checkpoint
        commands.append(["run", "--checkpoint", str(checkpoint), "--token-ids", TORCHRUN_IDS, "--out", str(traces[name]), *more])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    proc = subprocess.run(
        [*launch, "--master-port", str(port), "--no-python", sys.executable, "-c", RUN_EACH, json.dumps(commands)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return traces


@pytest.mark.parametrize("case", list(TORCHRUN_CASES))
def test_torchrun_two_ranks_write_the_one_process_trace(tiny_checkpoint, split_checkpoint, torchrun_traces, tmp_path, case):
    """Two ranks (gloo) write the one-process trace: the default sites bit for bit; the attribution,
    its sources and the contribution graph (the heads and the vocabulary gathered over the ranks)
    within float32 summation order."""
    more, split = TORCHRUN_CASES[case]
    checkpoint = split_checkpoint if split else tiny_checkpoint
    single = tmp_path / "single.safetensors"
    assert main(["run", "--checkpoint", str(checkpoint), "--token-ids", TORCHRUN_IDS, "--out", str(single), *more]) == 0
    a, b = Trace.load(single), Trace.load(torchrun_traces[case])
    assert set(a.tensors) == set(b.tensors)
    if split:
        assert a.extra["attribution"] == b.extra["attribution"]
        assert any(".attn.flow" in name for name in a.tensors) and any("attribution_src" in name for name in a.tensors)
    for name in a.tensors:
        if split and a[name].is_floating_point():  # split heads: partial sums meet in another float32 order
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, equal_nan=True)
            continue
        if more and a[name].is_floating_point():
            # one position at a time, the row-parallel partial sums meet in another float32 order than
            # in one process: values agree to the last bits, selections and generated tokens exactly
            torch.testing.assert_close(a[name], b[name], rtol=2**-7, atol=1e-5)
            continue
        if name.startswith("next.") and a[name].is_floating_point():
            # the head's vocabulary split changes the float32 products' blocking (the last bit), not the top tokens
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-7)
            continue
        assert torch.equal(a[name], b[name]), name  # default sites: bitwise the one-process values


def test_eval_prints_one_json_line(capsys, checkpoint_with_tokenizer, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 4, encoding="utf-8")
    code, out, err = run(capsys, "eval", "--checkpoint", str(checkpoint_with_tokenizer), "--text-file", str(text))
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert {"tokens", "mean_nll", "perplexity", "top1_accuracy", "bits_per_byte"} <= set(result)
    assert result["tokens"] > 0 and result["perplexity"] == pytest.approx(__import__("math").exp(result["mean_nll"]))
    (tmp_path / "empty.txt").write_text("")
    code, _, err = run(capsys, "eval", "--checkpoint", str(checkpoint_with_tokenizer), "--text-file", str(tmp_path / "empty.txt"))
    assert code == 2 and "empty" in err
    code, _, err = run(capsys, "eval", "--checkpoint", str(checkpoint_with_tokenizer), "--text-file", str(tmp_path / "none.txt"))
    assert code == 2 and "cannot read" in err


def test_run_says_what_it_did_in_one_line(tmp_path, capsys):
    from tracing.cli.loading import DEMO

    out = tmp_path / "t.safetensors"
    assert main(["run", "--checkpoint", str(DEMO), "--prompt", "Anne had not seen Captain", "--out", str(out)]) == 0
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("traced 7 tokens; next token ' Wentworth' (p=") and line.endswith(str(out))
    assert main(["run", "--checkpoint", str(DEMO), "--prompt", "Anne", "--generate", "3", "--out", str(out)]) == 0
    assert "; wrote 3 (length): '" in capsys.readouterr().err


def test_inexact_fp8_sums_are_asked_for_and_said(capsys, tiny_checkpoint, tmp_path):
    """The default trace sums FP8 products as the kernel does and says nothing; --inexact-fp8-sums
    runs the whole-K grouping in that command only and says so in the trace; a server's model runs
    as it was started, so the flag is refused with --server."""
    from model import fp8

    ids = ["--token-ids", ",".join(map(str, range(2, 40)))]
    code, _, err = run(capsys, "run", "--checkpoint", str(tiny_checkpoint), *ids, "--out", str(tmp_path / "a.safetensors"))
    assert code == 0, err
    code, _, err = run(
        capsys, "run", "--checkpoint", str(tiny_checkpoint), *ids, "--inexact-fp8-sums", "--out", str(tmp_path / "b.safetensors")
    )
    assert code == 0, err
    assert "fp8_sums" not in Trace.load(tmp_path / "a.safetensors").extra
    assert Trace.load(tmp_path / "b.safetensors").extra["fp8_sums"] == fp8.INEXACT_SUMS
    assert not fp8.sums_inexactly()  # the command's context ended with it
    code, _, err = run(capsys, "run", "--server", "http://127.0.0.1:9", *ids, "--inexact-fp8-sums", "--out", str(tmp_path / "c"))
    assert code == 2 and "--inexact-fp8-sums" in err and len(err.strip().splitlines()) == 1
