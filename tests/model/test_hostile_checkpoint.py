"""Crafted checkpoints: files outside the directory, deep JSON, absurd sizes, lists of end ids.
Each is refused with one line (exit status 2 on the command line) before it costs much, or works."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from model import TINY
from model.checkpoint import CheckpointError, SafetensorsSource, load_model
from model.config import MAX_EXPERT_MODULES, MAX_LAYERS, ConfigError, ModelArgs
from model.files import FileError, confined, loads
from model.synthetic import SyntheticSource
from tracing.cli.commands import main
from tracing.trace import Trace

INDEX = "model.safetensors.index.json"
DEEP = "[" * 100_000 + "]" * 100_000  # 200 KB: a RecursionError for json.loads


def bad_input(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    return target


def _edit_json(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _point_index_at(ckpt: Path, shard: str) -> None:
    """Let the index name ``shard`` for every tensor of the second shard."""

    def change(data):
        data["weight_map"] = {k: shard if v.endswith("00002.safetensors") else v for k, v in data["weight_map"].items()}

    _edit_json(ckpt / INDEX, change)


# confinement ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_an_index_naming_a_file_elsewhere_is_refused(capsys, ckpt, tmp_path, kind):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(ckpt / "model-00002-of-00002.safetensors", elsewhere / "x.safetensors")
    name = "../elsewhere/x.safetensors" if kind == "dotdot" else str(elsewhere / "x.safetensors")
    _point_index_at(ckpt, name)
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "not a plain relative name" in err and name in err
    with pytest.raises(CheckpointError, match="not a plain relative name"):
        load_model(ckpt)


def test_a_shard_symlinked_out_of_the_directory_is_refused(capsys, ckpt, tmp_path):
    outside = tmp_path / "outside.safetensors"
    (ckpt / "model-00002-of-00002.safetensors").rename(outside)
    (ckpt / "model-00002-of-00002.safetensors").symlink_to(outside)
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "outside the checkpoint directory" in err and "model-00002-of-00002.safetensors" in err
    out = tmp_path / "t.safetensors"
    bad_input(capsys, "run", "--checkpoint", ckpt, "--token-ids", "1,2,3", "--out", out)
    assert not out.exists()


def test_a_config_or_single_file_symlinked_out_is_refused(tiny_checkpoint, tmp_path):
    directory = tmp_path / "single"
    directory.mkdir()
    (directory / "config.json").symlink_to(tiny_checkpoint / "config.json")
    with pytest.raises(CheckpointError, match="config.json resolves to .* outside the checkpoint directory"):
        SafetensorsSource(directory)
    (directory / "config.json").unlink()
    shutil.copy(tiny_checkpoint / "config.json", directory / "config.json")
    (directory / "model.safetensors").symlink_to(tiny_checkpoint / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors resolves to .* outside"):
        SafetensorsSource(directory)


def test_the_hugging_face_cache_layout_loads(capsys, tiny_checkpoint, tmp_path):
    """Snapshot files are symlinks into the blobs/ folder of the same models--* tree."""
    tree = tmp_path / "hub" / "models--deepseek-ai--tiny"
    snapshot, blobs = tree / "snapshots" / "0123abc", tree / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, path in enumerate(sorted(tiny_checkpoint.iterdir())):
        shutil.copy(path, blobs / f"blob{i}")
        (snapshot / path.name).symlink_to(Path("../../blobs") / f"blob{i}")
    assert main(["info", "--checkpoint", str(snapshot)]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["n_layers"] == TINY.n_layers
    load_model(snapshot)
    # a link out of the tree is refused there too
    (tmp_path / "hub" / "stray").write_bytes((blobs / "blob1").read_bytes())
    (snapshot / "model-00001-of-00002.safetensors").unlink()
    (snapshot / "model-00001-of-00002.safetensors").symlink_to(tmp_path / "hub" / "stray")
    with pytest.raises(
        CheckpointError, match=r"outside the checkpoint directory .*\(or its cache tree .*models--deepseek-ai--tiny\)"
    ):
        SafetensorsSource(snapshot)


@pytest.mark.parametrize("name", ["", "a/../../b", "/etc/passwd", "x\x00y", 3, None])
def test_confined_refuses_names_that_are_not_plain(tmp_path, name):
    with pytest.raises(FileError):
        confined(tmp_path, name)
    assert confined(tmp_path, "sub/x.safetensors") == tmp_path / "sub" / "x.safetensors"


# deep and large JSON ------------------------------------------------------------------------------


def test_deeply_nested_config_and_index_are_refused_quickly(capsys, ckpt, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(DEEP)
    start = time.perf_counter()
    err = bad_input(capsys, "info", "--config", config)
    assert "nested more than 64 levels deep" in err
    (ckpt / INDEX).write_text('{"weight_map": ' + DEEP + "}")
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert f"{INDEX}: not a valid index (JSON nested more than 64 levels deep)" in err
    (ckpt / "config.json").write_text('{"model_type": ' + DEEP + "}")
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "config.json: not a readable JSON config (JSON nested" in err
    assert time.perf_counter() - start < 2


def _scan_seconds(text: str) -> float:
    """The fastest of three scans of ``text`` (a refusal counts as a scan)."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        try:
            loads(text)
        except FileError:
            pass
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize(
    "unit, head, tail",
    [("\\", '"', ""), ('\\"', '"', ""), ("[]", "", ""), ("[", '["', '"]')],
    ids=["backslashes", "escaped quotes", "empty lists", "brackets in a string"],
)
def test_the_nesting_scan_is_linear(unit, head, tail):
    """Eight times the text takes about eight times as long (a quadratic scan: 64 times), whatever else
    the machine is doing: the ratio, not a wall-clock limit."""
    small, large = (_scan_seconds(head + unit * n + tail) for n in (50_000, 400_000))
    assert large < 24 * max(small, 0.01)  # a floor: a scan of milliseconds is mostly noise


def test_strings_with_brackets_are_not_nesting():
    assert loads('{"a": "[[[[{{{{", "b": "\\"]]]"}', max_depth=1) == {"a": "[[[[{{{{", "b": '"]]]'}
    with pytest.raises(FileError, match="nested more than 2"):
        loads("[[[1]]]", max_depth=2)


# absurd sizes ----------------------------------------------------------------------------------------


def _config(tmp_path, **changes) -> Path:
    data = {**TINY.to_hf(), **changes}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"hidden_size": int("9" * 500)}, "dim must be at most 1048576, not a 1661-bit integer"),
        ({"hidden_size": 1e20}, "dim must be at most 1048576"),
        ({"hidden_size": 256.5}, "dim must be an integer, not 256.5"),
        ({"hidden_size": 0}, "dim must be positive, not 0"),
        ({"vocab_size": -512}, "vocab_size must be positive"),
        ({"num_hidden_layers": 10**9}, "n_layers must be at most 1048576, not 1000000000"),
        ({"num_hidden_layers": 5000}, f"5000 blocks and 0 MTP modules: more than {MAX_LAYERS} blocks"),
        ({"n_routed_experts": 10**8}, "n_routed_experts must be at most 1048576, not 100000000"),
        (
            {"n_routed_experts": 10**5, "n_group": 1, "topk_group": 1},
            f"200000 routed experts in all (MoE blocks x experts): more than {MAX_EXPERT_MODULES}",
        ),
        ({"max_position_embeddings": 2**40}, "max_seq_len must be at most 2147483647"),
        ({"hidden_size": list(range(100))}, "dim must be an integer, not [0, 1, 2,"),
        ({"bos_token_id": "0"}, "bos_token_id must be an integer or null, not '0'"),
    ],
    ids=[
        "500-digits",
        "1e20",
        "fraction",
        "zero",
        "negative",
        "1e9-layers",
        "5000-layers",
        "1e8-experts",
        "1e5-experts",
        "2^40-positions",
        "list",
        "bos",
    ],
)
def test_absurd_sizes_are_refused_at_once(capsys, tmp_path, changes, words):
    path = _config(tmp_path, **changes)
    start = time.perf_counter()
    err = bad_input(capsys, "info", "--config", path)
    assert words in err and len(err) < 400
    bad_input(capsys, "run", "--synthetic", path, "--token-ids", "1", "--out", tmp_path / "t.safetensors")
    assert time.perf_counter() - start < 2


def test_a_crafted_config_costs_little_in_a_fresh_process(tmp_path):
    """The target: under 2 s and 500 MB of its own before the refusal (torch's import aside)."""
    path = _config(tmp_path, num_hidden_layers=10**9, first_k_dense_replace=10**9 - 1)
    # peaks as the process's own VmHWM (KiB), not ru_maxrss: Linux carries the forking worker's
    # peak across exec into the child's ru_maxrss
    code = (
        "import time; import torch; from tracing.cli.commands import main; "
        "hwm = lambda: int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1]); "
        "before = hwm(); t = time.perf_counter(); "
        f"code = main(['info', '--config', {str(path)!r}]); "
        "print(code, time.perf_counter() - t, (hwm() - before) / 1024, hwm())"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    code, seconds, grown_mb, peak_kib = proc.stdout.split()
    assert code == "2" and float(seconds) < 2 and float(grown_mb) < 500, proc.stdout + proc.stderr
    assert int(peak_kib) < 2 << 20  # the whole process under 2 GiB


def test_a_config_larger_than_its_checkpoint_is_refused_before_building(capsys, ckpt):
    _edit_json(ckpt / "config.json", lambda d: d.update(num_hidden_layers=1000))
    start = time.perf_counter()
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "describes 1000 blocks, the checkpoint holds no tensor of block 3" in err
    _edit_json(ckpt / "config.json", lambda d: d.update(num_hidden_layers=TINY.n_layers, n_routed_experts=4096))
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "describes 4096 routed experts per block, block 1 of the checkpoint holds tensors of 16" in err
    assert time.perf_counter() - start < 2


def test_weights_larger_than_free_memory_are_refused_before_allocating(capsys, tmp_path):
    args = TINY.replace(vocab_size=2**20, dim=2**20)  # a 2 TiB embedding alone, on the meta device for free
    with pytest.raises(CheckpointError, match=r"the weights take [\d,.]+ GiB and cpu has [\d,.]+ GiB free: stream them"):
        load_model(SyntheticSource(args))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(args.to_hf()))
    out = tmp_path / "t.safetensors"
    err = bad_input(capsys, "run", "--synthetic", path, "--token-ids", "1", "--out", out)  # streamed: too large to load
    assert "embed alone takes 2,048.0 GiB and cpu has" in err
    assert not out.exists()


# end-of-sequence ids ---------------------------------------------------------------------------------


def test_eos_token_id_as_a_list_or_none():
    assert ModelArgs.from_hf({**TINY.to_hf(), "eos_token_id": [5, 1]}).eos_token_id == (5, 1)
    assert ModelArgs.from_hf({**TINY.to_hf(), "eos_token_id": 7}).eos_token_id == (7,)
    assert ModelArgs.from_hf({**TINY.to_hf(), "eos_token_id": None}).eos_token_id == ()
    args = TINY.replace(eos_token_id=[5, 1])
    assert args.is_eos(1) and args.is_eos(5) and not args.is_eos(2)
    assert hash(args) == hash(TINY.replace(eos_token_id=(5, 1)))  # cached by configuration (tracing.sites)
    assert ModelArgs.from_hf(args.to_hf()).eos_token_id == (5, 1)
    assert TINY.replace(eos_token_id=3).to_hf()["eos_token_id"] == 3


@pytest.mark.parametrize("value", ["1", [1, "2"], [1, 2.5], True, [None], {"id": 1}, -1, 2**40])
def test_a_non_integer_eos_token_id_is_refused(capsys, ckpt, value):
    with pytest.raises(ConfigError, match="eos_token_id must be"):
        ModelArgs.from_hf({**TINY.to_hf(), "eos_token_id": value})
    _edit_json(ckpt / "config.json", lambda d: d.update(eos_token_id=value))
    assert "eos_token_id must be" in bad_input(capsys, "info", "--checkpoint", ckpt)
    _edit_json(ckpt / "config.json", lambda d: d.update(eos_token_id=1))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
    err = bad_input(capsys, "info", "--checkpoint", ckpt)
    assert "generation_config.json: eos_token_id must be" in err


def _generated(capsys, ckpt, tmp_path, n=6) -> tuple[list[int], dict]:
    out = tmp_path / "g.safetensors"
    out.unlink(missing_ok=True)
    assert main(["run", "--checkpoint", str(ckpt), "--token-ids", "3,4,5", "--generate", str(n), "--out", str(out)]) == 0, (
        capsys.readouterr().err
    )
    trace = Trace.load(out)
    return [int(t) for t in trace.tensors["tokens"]][3:], trace.extra["generation"]


def test_generation_stops_at_any_listed_eos_id(capsys, ckpt, tmp_path):
    _edit_json(ckpt / "config.json", lambda d: d.pop("eos_token_id", None))
    free, info = _generated(capsys, ckpt, tmp_path)
    assert info["stopped"] == "length" and len(free) == 6
    second = free[1]
    unused = next(i for i in range(TINY.vocab_size) if i not in free)
    if second in free[:1]:
        pytest.skip("the tiny model repeats its first token")
    _edit_json(ckpt / "config.json", lambda d: d.update(eos_token_id=[unused, second]))
    tokens, info = _generated(capsys, ckpt, tmp_path)
    assert tokens == free[:2] and info["stopped"] == "eos"
    # generation_config.json's ids stop it too
    _edit_json(ckpt / "config.json", lambda d: d.update(eos_token_id=unused))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [unused, second]}))
    assert SafetensorsSource(ckpt).args.eos_token_id == (unused, second)
    tokens, info = _generated(capsys, ckpt, tmp_path)
    assert tokens == free[:2] and info["stopped"] == "eos"
