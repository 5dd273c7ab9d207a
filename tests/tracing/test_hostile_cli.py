"""Hostile input to the command line, second round: outputs never replace what is not theirs, no
input gives a traceback, every input's cost is bounded before the work starts, and nothing is
silent or misleading (a flag's non-finite number, an intervention's own mask, a changed checkpoint)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file

from model import TINY
from model.checkpoint import load_model
from tracing.analyses.interventions import AblateExperts
from tracing.atlas.corpus import Corpus, Source
from tracing.cli.commands import main
from tracing.cli.loading import DEMO
from tracing.runner import trace_tokens
from tracing.sites import LOGIT_LENS
from tracing.tokenizer import Tokenizer
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[2]
IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61]
SAMPLE = DEMO / "heldout_sample.txt"
ATLAS = ["atlas", "--checkpoint", "demo", "--text-file", str(SAMPLE), "--seq-len", "64", "--max-tokens", "200"]

demo_only = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def refused(capsys, *argv) -> str:
    """Run; assert status 2 with one error line and no traceback; return the line."""
    code, _, err = cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.fixture(scope="module")
def trace(tiny_model):
    return trace_tokens(tiny_model, IDS, prompt="p", record=["default", LOGIT_LENS])


@pytest.fixture(scope="module")
def attributed(tiny_model):
    from tracing.analyses.attribution import AttributionRequest

    return trace_tokens(tiny_model, IDS, attribution=AttributionRequest(None, None, None))


def write(path: Path, trace: Trace, tensors=None, config=None, **extra) -> Path:
    """A trace file as a foreign writer could make it: ``tensors`` instead of the trace's, ``config``
    merged into its config, ``extra`` merged into its extra metadata."""
    meta = trace.metadata()
    if config is not None:
        meta["config"] = json.dumps({**json.loads(meta["config"]), **config})
    meta["extra"] = json.dumps({**trace.extra, **extra})
    tensors = trace.tensors if tensors is None else tensors
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path), metadata=meta)
    return path


def hidden(directory: Path) -> list[str]:
    return [p.name for p in directory.rglob(".*")]


# 5. outputs never overwrite what is not theirs ------------------------------------------------------
def _sigterm_during(monkeypatch, target, name):
    original = getattr(target, name)

    def write_then_terminate(*args, **kwargs):
        out = original(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(target, name, write_then_terminate)


@demo_only
@pytest.mark.parametrize(
    "case", ["atlas into a directory of other files", "an empty path", "SIGTERM in export", "SIGTERM in atlas"]
)
def test_outputs_never_replace_what_is_not_theirs(capsys, monkeypatch, tmp_path, trace, case):
    if case == "an empty path":  # an unset variable in --out "$DIR" is the current directory, or no tables at all
        saved = trace.save(tmp_path / "t.safetensors")
        monkeypatch.chdir(tmp_path)
        run = ["run", "--checkpoint", "demo", "--token-ids", "1,2,3"]
        for argv in ([*run, "--out", ""], [*run, "--out", "u.safetensors", "--csv", ""], [*ATLAS, "--out", ""]):
            assert "empty path" in refused(capsys, *argv)
        assert "empty path" in refused(capsys, "diff", saved, saved, "--csv", "")
        assert os.listdir(tmp_path) == ["t.safetensors"]
        return
    if case == "atlas into a directory of other files":
        mine = tmp_path / "mine"
        mine.mkdir()
        (mine / "summary.json").write_text('{"my": "results"}')
        pd.DataFrame({"a": [1]}).to_parquet(mine / "expert_load.parquet")
        before = {p.name: p.read_bytes() for p in mine.iterdir()}
        line = refused(capsys, *ATLAS, "--out", mine)
        assert "not an atlas directory" in line
        assert {p.name: p.read_bytes() for p in mine.iterdir()} == before
        return
    if case == "SIGTERM in export":
        import tracing.tables.files as files

        _sigterm_during(monkeypatch, files, "to_csv_bytes")
        argv = ["export", trace.save(tmp_path / "t.safetensors"), "--csv", tmp_path / "csv"]
    else:
        _sigterm_during(monkeypatch, pd.DataFrame, "to_parquet")
        argv = [*ATLAS, "--out", tmp_path / "atlas"]
    code, _, err = cli(capsys, *argv)
    assert code == 143 and err.strip() == "error: terminated" and "Traceback" not in err, err
    assert not hidden(tmp_path) and not (tmp_path / "csv").exists()
    assert not (tmp_path / "atlas" / "summary.json").exists()


# 6. no traceback for any input ----------------------------------------------------------------------
def _deep_jsonl(tmp: Path) -> list:
    path = tmp / "deep.jsonl"
    path.write_text('{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    return ["atlas", "--checkpoint", "demo", "--jsonl", path, "--out", tmp / "atlas"]


def _other_vocabulary(tmp: Path, trace: Trace) -> list:
    tensors = dict(trace.tensors)
    tensors["logits.last"] = torch.zeros(1024)
    for name in [n for n in tensors if "logit_lens" in n]:
        del tensors[name]
    other = write(tmp / "b.safetensors", trace, tensors, {"vocab_size": 1024})
    return ["diff", trace.save(tmp / "a.safetensors"), other]


def _extra(**extra):
    return lambda tmp, trace: ["export", write(tmp / "t.safetensors", trace, **extra), "--csv", tmp / "csv"]


def _without(*names, attributed_trace=False):
    def make(tmp, trace, attributed):
        source = attributed if attributed_trace else trace
        tensors = {n: t for n, t in source.tensors.items() if n not in names}
        return ["export", write(tmp / "t.safetensors", source, tensors), "--csv", tmp / "csv"]

    return make


NO_TRACEBACK = {
    "--target ²": lambda tmp, ckpt: (
        ["run", "--checkpoint", ckpt, "--token-ids", "1,2,3", "--out", tmp / "t", "--attribute"] + ["--target", "²"]
    ),
    "--ablate-heads 1:²": lambda tmp, ckpt: (
        ["run", "--checkpoint", ckpt, "--token-ids", "1,2,3", "--out", tmp / "t"] + ["--ablate-heads", "1:²"]
    ),
    "--prefill ²": lambda tmp, ckpt: ["run", "--checkpoint", ckpt, "--token-ids", "1,2,3", "--out", tmp / "t", "--prefill", "²"],
    "a seed beyond 64 bits": lambda tmp, ckpt: (
        ["run", "--checkpoint", ckpt, "--token-ids", "1,2,3", "--out", tmp / "t"]
        + ["--generate", "2", "--temperature", "1", "--seed", str(2**70)]
    ),
    "serve --port 99999": lambda tmp, ckpt: ["serve", "--checkpoint", ckpt, "--port", "99999"],
    'info --checkpoint ""': lambda tmp, ckpt: ["info", "--checkpoint", ""],
    "--device meta": lambda tmp, ckpt: [
        "run",
        "--checkpoint",
        ckpt,
        "--token-ids",
        "1,2,3",
        "--out",
        tmp / "t",
        "--device",
        "meta",
    ],
}
BAD_TRACES = {
    "generation a string": _extra(generation="yes"),
    "prefill a string": _extra(prefill="3"),
    "attribution an int": _extra(attribution=3),
    "next.topk_probs without its indices": _without("next.topk_indices"),
    "no attribution.embed": _without("attribution.embed", attributed_trace=True),
    "one block's ffn.attribution missing": _without("layers.1.ffn.attribution", attributed_trace=True),
}


@demo_only
@pytest.mark.parametrize("ids", ["-5", "5,-1", str(2**70)])
def test_a_checkpoint_diff_refuses_an_id_outside_the_vocabulary_before_decoding_it(capsys, tmp_path, ids):
    """Both tokenizers read each prompt token's text to compare them: an id no tokenizer can decode is
    refused in one line first, as `run` refuses it."""
    other = shutil.copytree(DEMO, tmp_path / "demo2")
    line = refused(capsys, "diff", "--checkpoint", "demo", "--against", other, f"--token-ids={ids}")
    assert "outside the vocabulary" in line or "--token-ids" in line, line


@pytest.mark.parametrize("case", [*NO_TRACEBACK, *BAD_TRACES, "deep JSONL", "other vocabularies"])
def test_no_input_gives_a_traceback(capsys, tmp_path, tiny_checkpoint, trace, attributed, case):
    if case in NO_TRACEBACK:
        argv = NO_TRACEBACK[case](tmp_path, tiny_checkpoint)
    elif case in BAD_TRACES:
        make = BAD_TRACES[case]
        argv = make(tmp_path, trace, attributed) if make.__name__ == "make" else make(tmp_path, trace)
    elif case == "deep JSONL":
        argv = _deep_jsonl(tmp_path)
    else:
        argv = _other_vocabulary(tmp_path, trace)
    refused(capsys, *argv)
    assert not (tmp_path / "csv").exists() and not (tmp_path / "t").exists()


DAMAGE = {
    "a total missing": lambda s: {k: v for k, v in s.items() if k != "expert_token_keys"},
    "float keys": lambda s: {**s, "expert_token_keys": s["expert_token_keys"].double()},
    "a negative id": lambda s: {**s, "expert_token_keys": torch.cat([torch.tensor([-5]), s["expert_token_keys"][1:]])},
    "a huge id": lambda s: {**s, "expert_token_keys": torch.cat([s["expert_token_keys"][:-1], torch.tensor([2**62])])},
    "a negative count": lambda s: {**s, "expert_count": -s["expert_count"]},
}


@demo_only
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_atlas_checkpoint_is_refused_before_any_batch(capsys, tmp_path, damage):
    out = tmp_path / "atlas"
    assert cli(capsys, *ATLAS, "--out", out)[0] == 0
    state = out / "atlas_state.safetensors"
    from safetensors import safe_open

    with safe_open(str(state), framework="pt") as f:
        meta = f.metadata()
    save_file(DAMAGE[damage](load_file(str(state))), str(state), metadata={**meta, "done_batches": "0"})
    (out / "summary.json").unlink()
    damaged = state.read_bytes()
    line = refused(capsys, *ATLAS, "--out", out, "--resume")
    assert "atlas_state.safetensors" in line
    assert state.read_bytes() == damaged and not (out / "summary.json").exists()


def test_ctrl_c_while_the_imports_run_is_one_line(tmp_path):
    """SIGINT once torch is loading (seen in the process's memory maps), before any command runs."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tracing", "info", "--config", str(REPO / "assets/configs/config_671B_hf.json")],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None and "torch" not in maps.read_text(errors="replace"):
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=60)[1]
    assert "Traceback" not in err, err
    assert proc.returncode == 130 and err.strip() == "error: interrupted", (proc.returncode, err)


# 7. bounded cost for every input --------------------------------------------------------------------
def _tokens_only(tmp: Path, trace: Trace) -> Path:
    n = 20_000  # 160 KB of ids
    ids = torch.randint(0, TINY.vocab_size, (n,))
    small = Trace({"tokens": ids}, trace.config, ["x"] * n)
    return small.save(tmp / "t.safetensors")


def _wide_router(tmp: Path, trace: Trace) -> Path:
    """A 1 MB file: 16,000 positions' choices in one block of a config claiming 4096 experts."""
    n, k = 16_000, TINY.n_activated_experts
    chosen = torch.stack([torch.randperm(4096)[:k] for _ in range(64)]).repeat(n // 64, 1)
    tensors = {"tokens": torch.zeros(n, dtype=torch.int64), "layers.1.ffn.gate.topk_indices": chosen}
    wide = Trace(tensors, trace.config.replace(n_routed_experts=4096), ["x"] * n)
    return wide.save(tmp / "t.safetensors")


def _many_blocks(tmp: Path, trace: Trace) -> Path:
    """One position routed in each of 4095 blocks of 4096 experts: 16 million block-expert rows
    (written as a foreign writer would, whatever limits ModelArgs sets)."""
    tensors = {"tokens": torch.zeros(1, dtype=torch.int64)}
    tensors |= {f"layers.{i}.ffn.gate.topk_indices": torch.arange(TINY.n_activated_experts)[None] for i in range(1, 4096)}
    meta = Trace({"tokens": tensors["tokens"]}, trace.config, ["x"]).metadata()
    meta["config"] = json.dumps({**json.loads(meta["config"]), "n_layers": 4096, "n_routed_experts": 4096})
    save_file(tensors, str(tmp / "t.safetensors"), metadata=meta)
    return tmp / "t.safetensors"


@pytest.mark.parametrize("case", ["tokens only", "a wide router", "many blocks", "a huge text", "non-regular files"])
def test_a_small_input_costs_little_before_it_is_refused_or_read(capsys, tmp_path, trace, case):
    start = time.process_time()
    if case == "a huge text":
        if not (DEMO / "tokenizer.json").is_file():
            pytest.skip("assets/demo is not there")
        text = tmp_path / "one-line.txt"
        text.write_text("word " * 1_000_000)  # 5 MB on one line
        survey = Corpus([Source(text)], Tokenizer(DEMO), 64, 4, max_tokens=1000).survey()
        assert survey.tokens == 1000
    elif case == "non-regular files":
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        for path in (fifo, Path("/dev/zero")):
            assert "not a regular file" in refused(capsys, "info", "--config", path)
            assert "not a regular file" in refused(capsys, "eval", "--checkpoint", "demo", "--text-file", path)
            assert "not a regular file" in refused(capsys, *ATLAS[:3], "--text-file", path, "--out", tmp_path / "a")
    else:
        path = {"tokens only": _tokens_only, "a wide router": _wide_router, "many blocks": _many_blocks}[case](tmp_path, trace)
        assert path.stat().st_size < 1 << 20
        code, _, err = cli(capsys, "export", path, "--csv", tmp_path / "csv")
        assert code == (2 if case == "many blocks" else 0), err
    assert time.process_time() - start < 2


# 8. nothing silent or misleading --------------------------------------------------------------------
MISLEADING = {
    "--target X --contrast X": ["--attribute", "--target", "5", "--contrast", "5"],
    "--temperature inf": ["--generate", "2", "--temperature", "inf"],
    "--top-p nan": ["--generate", "2", "--temperature", "1", "--top-p", "nan"],
    '--record ""': ["--record", ""],
    '--patch ""': ["--patch", ""],
    "a removal past the last position": ["--zero-experts", "1:0@3:"],  # three tokens: positions 0..2
    "a removal past the generation": ["--ablate-heads", "1:0@6", "--generate", "2"],
}


OTHER_MISLEADING = [
    "--contrast the default target",
    "a patch forcing one expert twice",
    "--checkpoint-every nan",
    "wrong messages",
]


@pytest.mark.parametrize("case", [*MISLEADING, *OTHER_MISLEADING])
def test_nothing_is_silent_or_misleading(capsys, tmp_path, tiny_checkpoint, tiny_source, case):
    if case == "a patch forcing one expert twice":
        chosen = torch.arange(TINY.n_activated_experts).repeat(3, 1)
        chosen[1, 1] = chosen[1, 0]
        save_file({"layers.1.ffn.gate.topk_indices": chosen}, str(tmp_path / "p.safetensors"))
        argv = ["run", "--checkpoint", tiny_checkpoint, "--token-ids", "1,2,3", "--out", tmp_path / "t"]
        assert "twice" in refused(capsys, *argv, "--patch", tmp_path / "p.safetensors")
        chosen[1, 1] = TINY.n_activated_experts
        save_file({"layers.1.ffn.gate.topk_indices": chosen}, str(tmp_path / "p.safetensors"))
        assert cli(capsys, *argv, "--patch", tmp_path / "p.safetensors")[0] == 0
    elif case in MISLEADING:
        refused(
            capsys, "run", "--checkpoint", tiny_checkpoint, "--token-ids", "1,2,3", "--out", tmp_path / "t", *MISLEADING[case]
        )
        assert not (tmp_path / "t").exists()
    elif case == "--checkpoint-every nan":
        assert "finite" in refused(capsys, *ATLAS, "--out", tmp_path / "a", "--checkpoint-every", "nan")
    else:
        (tmp_path / "loop").symlink_to(tmp_path / "loop")
        (tmp_path / "dir").mkdir()
        says = {"dir": "is a directory", "loop": "symbolic links", "/proc/self/status": "cannot be mapped"}
        for name, message in says.items():
            line = refused(capsys, "export", tmp_path / name, "--csv", tmp_path / "csv")
            assert message in line and "no such" not in line and "os error" not in line, line
    if case == "--temperature inf":  # nor does a number that slipped through become non-standard JSON
        with pytest.raises(ValueError):
            Trace({"tokens": torch.tensor([1])}, TINY, ["a"], extra={"x": float("inf")}).metadata()


def test_an_intervention_s_own_mask_is_not_a_non_finite_value(tiny_source):
    """Ablated experts leave -inf in the biased scores on purpose: no warning for it, and a later
    real NaN (block 2's FFN norm) is still the one reported."""
    model = load_model(tiny_source)
    ablate = [AblateExperts({1: (3,), 2: (0, 1, 2)})]
    assert "nonfinite" not in trace_tokens(model, IDS, record="all", interventions=ablate).extra
    with torch.no_grad():
        model.layers[2].ffn_norm.weight[3] = float("nan")
    bad = trace_tokens(model, IDS, record="all", interventions=ablate).extra["nonfinite"]
    assert bad["site"].startswith("layers.2.") and bad["position"] == 0, bad


@demo_only
def test_resume_refuses_weights_changed_in_place(capsys, tmp_path):
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(DEMO, checkpoint)
    argv = [*ATLAS[:2], checkpoint, *ATLAS[3:], "--out", tmp_path / "atlas"]
    assert cli(capsys, *argv)[0] == 0
    shard = next(checkpoint.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    assert "weight files changed" in refused(capsys, *argv, "--resume")
    from tracing.atlas import AtlasError, build_atlas
    from tracing.cli.loading import open_checkpoint

    with pytest.raises(AtlasError, match="weight files changed"):  # the Python API fingerprints them too
        os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
        build_atlas(open_checkpoint(checkpoint), [Source(SAMPLE)], tmp_path / "atlas", seq_len=64, max_tokens=200, resume=True)
