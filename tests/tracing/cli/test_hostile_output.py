"""Outputs of the command line in hostile places: what is not a regular file is refused, a write
that fails exits 2 with one line and leaves nothing behind, a reused CSV directory holds only this
run's tables, and diff's summary line is valid JSON whatever numbers the traces hold."""

import json
import os
import resource
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tracing.cli.commands import main
from tracing.trace import Trace

IDS = "1,2,3"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def trace_run(capsys, checkpoint, out, *extra):
    return run(capsys, "run", "--checkpoint", checkpoint, "--token-ids", IDS, "--out", out, *extra)


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture(scope="module")
def saved(tiny_checkpoint, tmp_path_factory):
    """One trace file of the tiny checkpoint, for export and diff."""
    path = tmp_path_factory.mktemp("saved") / "t.safetensors"
    assert main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", IDS, "--out", str(path)]) == 0
    return path


def _symlink(path):
    target = path.parent / "precious.txt"
    target.write_text("keep me")
    path.symlink_to(target)


def _device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # the same device as /dev/full
    except PermissionError:
        pytest.skip("no permission to make a device node here")


MAKERS = {
    "symlink": _symlink,
    "fifo": os.mkfifo,
    "device": _device,
    "directory": os.mkdir,
}


@pytest.mark.parametrize("kind", MAKERS)
def test_out_that_is_not_a_regular_file_is_refused_and_left_alone(capsys, tiny_checkpoint, tmp_path, kind):
    out = tmp_path / "t.safetensors"
    MAKERS[kind](out)
    before = sorted(os.listdir(tmp_path))
    mode = out.lstat().st_mode
    code, _, err = trace_run(capsys, tiny_checkpoint, out)
    line = one_error_line(err)
    assert code == 2 and str(out) in line and "refusing to replace it" in line, err
    assert out.lstat().st_mode == mode and sorted(os.listdir(tmp_path)) == before
    if kind == "symlink":
        assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_out_replaces_a_regular_file_with_sensible_permissions(capsys, tiny_checkpoint, tmp_path):
    old = os.umask(0o022)
    try:
        new = tmp_path / "new.safetensors"
        code, _, err = trace_run(capsys, tiny_checkpoint, new)
        assert code == 0, err
        assert stat.S_IMODE(new.stat().st_mode) == 0o644  # what the umask gives, not mkstemp's 0600
        existing = tmp_path / "existing.safetensors"
        existing.write_bytes(b"an old run")
        existing.chmod(0o640)
        code, _, err = trace_run(capsys, tiny_checkpoint, existing)
        assert code == 0, err
        assert Trace.load(existing).token_ids == [1, 2, 3] and stat.S_IMODE(existing.stat().st_mode) == 0o640
        assert sorted(os.listdir(tmp_path)) == ["existing.safetensors", "new.safetensors"]
    finally:
        os.umask(old)


@pytest.mark.parametrize(
    "case",
    ["out in /proc", "out under /proc/self", "out under a regular file", "csv onto a regular file", "csv under a regular file"],
)
def test_a_write_that_fails_exits_2_naming_the_path_and_leaves_nothing(capsys, tiny_checkpoint, tmp_path, case):
    (tmp_path / "file").write_text("a regular file")
    out, csv, named = tmp_path / "t.safetensors", None, None
    if case == "out in /proc":
        out = named = "/proc/hostile-output.safetensors"
    elif case == "out under /proc/self":
        out = named = "/proc/self/hostile/t.safetensors"
    elif case == "out under a regular file":
        out = named = tmp_path / "file" / "t.safetensors"
    elif case == "csv onto a regular file":
        csv = named = tmp_path / "file"
    else:
        csv = named = tmp_path / "file" / "csv"
    code, _, err = trace_run(capsys, tiny_checkpoint, out, *(["--csv", csv] if csv else []))
    line = one_error_line(err)
    assert code == 2 and str(named) in line, err
    assert line.rstrip().endswith(")") or "not a directory" in line, line  # the OS reason, in brackets
    assert sorted(os.listdir(tmp_path)) == ["file"] and (tmp_path / "file").read_text() == "a regular file"


def test_a_table_that_cannot_be_placed_leaves_no_trace_either(capsys, tiny_checkpoint, tmp_path):
    """The tables are staged with the trace: when one cannot land, neither does the trace."""
    csv = tmp_path / "csv"
    (csv / "tokens.csv").mkdir(parents=True)
    out = tmp_path / "t.safetensors"
    code, _, err = trace_run(capsys, tiny_checkpoint, out, "--csv", csv)
    line = one_error_line(err)
    assert code == 2 and str(csv / "tokens.csv") in line, err
    assert not out.exists() and os.listdir(csv) == ["tokens.csv"] and sorted(os.listdir(tmp_path)) == ["csv"]


def _file_size_limit(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_full_disk_exits_2_and_leaves_nothing(tiny_checkpoint, tmp_path):
    """A file-size limit stands in for a full file system: the write stops part way."""
    out = tmp_path / "sub" / "t.safetensors"
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", IDS, "--out", str(out), "--csv", str(tmp_path / "csv")]
    code = f"import sys; from tracing.cli import main; sys.exit(main({argv!r}))"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=_file_size_limit(4096), timeout=600, env=env
    )
    line = one_error_line(done.stderr)
    assert done.returncode == 2 and str(out) in line and "File too large" in line, done.stderr
    assert os.listdir(tmp_path) == []


def test_a_reused_csv_directory_holds_only_this_runs_tables(capsys, saved, tmp_path):
    csv = tmp_path / "csv"
    csv.mkdir()
    (csv / "notes.txt").write_text("mine")
    (csv / "mine.csv").write_text("a,b\r\n1,2\r\n")
    code, _, err = run(capsys, "export", saved, "--csv", csv, "--parquet")
    assert code == 0, err
    tables = {p.stem for p in csv.glob("*.parquet")}
    assert {"tokens", "router", "residual"} <= tables
    mine = {"notes.txt", "mine.csv"}
    assert set(os.listdir(csv)) == mine | {f"{t}.csv" for t in tables} | {f"{t}.parquet" for t in tables}
    code, _, err = run(capsys, "export", saved, "--csv", csv)  # no Parquet this time: the old ones go
    assert code == 0, err
    assert set(os.listdir(csv)) == mine | {f"{t}.csv" for t in tables}
    code, out, err = run(capsys, "diff", saved, saved, "--csv", csv)  # other tables: the trace's go
    assert code == 0, err
    diffs = {"blocks.csv", "stream.csv", "experts.csv", "indexer_keys.csv", "attention.csv", "next_token.csv"}
    assert set(os.listdir(csv)) == mine | diffs
    assert (csv / "notes.txt").read_text() == "mine" and json.loads(out)["tokens"] == 3


def _strict(text: str):
    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_diff_of_traces_with_nan_prints_valid_json(capsys, saved, tmp_path):
    trace = Trace.load(saved)
    tensors = dict(trace.tensors)
    tensors["layers.1.resid_post"] = tensors["layers.1.resid_post"].clone()
    tensors["layers.1.resid_post"][2, 0] = float("nan")
    tensors["logits.last"] = torch.full_like(tensors["logits.last"], float("nan"))
    nan = Trace(tensors, trace.config, trace.tokens, trace.prompt, trace.extra).save(tmp_path / "nan.safetensors")
    code, out, err = run(capsys, "diff", saved, nan)
    assert code == 0, err
    summary = _strict(out)
    per_layer = summary["max_rel_l2_per_block"]
    assert per_layer[1] is None and all(isinstance(v, float) for i, v in enumerate(per_layer) if i != 1)
    assert summary["next_token_kl"] is None
