"""Crafted tokenizer files: one clear line (exit status 2 on the command line), never a traceback."""

import json
import shutil
import time
from pathlib import Path

import pytest

from tests.devcheckpoint import make_dev_checkpoint
from tracing.cli.commands import main
from tracing.tokenizer import Tokenizer, TokenizerError


@pytest.fixture(scope="module")
def dev_checkpoint(tmp_path_factory) -> Path:
    return make_dev_checkpoint(tmp_path_factory.mktemp("tok") / "ckpt")


@pytest.fixture
def ckpt(dev_checkpoint, tmp_path) -> Path:
    target = tmp_path / "ckpt"
    shutil.copytree(dev_checkpoint, target)
    return target


def refused(capsys, ckpt: Path, tmp_path: Path) -> str:
    """The one stderr line of a run with a prompt (the tokenizer is read), which writes nothing."""
    out = tmp_path / "t.safetensors"
    code = main(["run", "--checkpoint", str(ckpt), "--prompt", "The quick", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert not out.exists()
    return err


def _config(ckpt: Path, data) -> None:
    (ckpt / "tokenizer_config.json").write_text(data if isinstance(data, str) else json.dumps(data))


@pytest.mark.parametrize(
    "data, words",
    [
        ([1, 2], "tokenizer_config.json: must be a JSON object, not list"),
        ("nope", "tokenizer_config.json: not valid JSON"),
        ({"bos_token": 5, "add_bos_token": True}, "tokenizer_config.json: bos_token must be a token's text, not int 5"),
        ({"eos_token": ["<eos>"]}, "eos_token must be a token's text, not list"),
        ({"bos_token": {"content": 7}}, "bos_token must be a token's text, not int 7"),
        ({"bos_token": "<bos>", "add_bos_token": "yes"}, "add_bos_token must be true or false, not yes"),
        ("[" * 100_000 + "]" * 100_000, "tokenizer_config.json: JSON nested more than 64 levels deep"),
    ],
    ids=["list", "not-json", "numeric-bos", "list-eos", "numeric-content", "string-flag", "deep"],
)
def test_a_bad_tokenizer_config_is_refused(capsys, ckpt, tmp_path, data, words):
    _config(ckpt, data)
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer(ckpt)
    assert words in refused(capsys, ckpt, tmp_path)
    assert time.perf_counter() - start < 2


def test_the_usual_forms_still_read(ckpt):
    _config(ckpt, {"bos_token": {"content": "<bos>"}, "eos_token": "<eos>", "add_bos_token": True})
    tok = Tokenizer(ckpt)
    assert tok.add_bos and tok.encode("The")[0] == tok.bos_id == 0 and tok.eos_id == 1
    _config(ckpt, {"bos_token": None, "add_bos_token": None})
    tok = Tokenizer(ckpt)
    assert not tok.add_bos and tok.bos_id is None and tok.eos_id is None


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json"])
def test_a_tokenizer_file_symlinked_out_of_the_checkpoint_is_refused(capsys, ckpt, tmp_path, name):
    outside = tmp_path / f"outside-{name}"
    (ckpt / name).rename(outside)
    (ckpt / name).symlink_to(outside)
    with pytest.raises(TokenizerError, match=f"{name} resolves to .* outside the checkpoint directory"):
        Tokenizer(ckpt)
    assert "outside the checkpoint directory" in refused(capsys, ckpt, tmp_path)
