"""--chat: a user turn in DeepSeek-V3.2's conversation format, or a clear refusal."""

import shutil

import pytest

from tests.devcheckpoint import train_tokenizer
from tracing.chat import ASSISTANT, BOS, END_THINK, THINK, USER, encode_chat
from tracing.cli.commands import main
from tracing.tokenizer import Tokenizer, TokenizerError
from tracing.trace import Trace

MARKERS = [BOS, "<｜end▁of▁sentence｜>", USER, ASSISTANT, THINK, END_THINK]


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with a byte-level BPE tokenizer that has the chat markers."""
    directory = tmp_path_factory.mktemp("chat") / "ckpt"
    shutil.copytree(tiny_checkpoint, directory)
    train_tokenizer(directory, ["What is sparse attention? It keeps the keys that matter. " * 20], 512, MARKERS)
    return directory


def test_a_chat_turn_is_framed_by_the_markers(chat_checkpoint):
    tok = Tokenizer(chat_checkpoint)
    ids = encode_chat(tok, "What is sparse attention?")
    marker = {name: tok.token_id(name) for name in MARKERS}
    assert ids[0] == marker[BOS] and ids[-2:] == [marker[ASSISTANT], marker[END_THINK]]
    user = ids.index(marker[USER])
    assert tok.decode(ids[user + 1 : -2]) == "What is sparse attention?"
    assert encode_chat(tok, "Hi", thinking=True)[-1] == marker[THINK]
    system = encode_chat(tok, "Hi", system="Be brief.")
    assert tok.decode(system[1 : system.index(marker[USER])]) == "Be brief."


def test_the_cli_generates_an_answer_to_a_chat_turn(chat_checkpoint, tmp_path):
    out = tmp_path / "t.safetensors"
    argv = ["run", "--checkpoint", str(chat_checkpoint), "--prompt", "What is sparse attention?", "--chat", "--out", str(out)]
    assert main([*argv, "--generate", "3"]) == 0
    trace = Trace.load(out)
    tok = Tokenizer(chat_checkpoint)
    assert trace.token_ids[: trace.extra["generation"]["start"]] == encode_chat(tok, "What is sparse attention?")


def test_a_tokenizer_without_the_markers_refuses_chat(capsys, app_checkpoint, tmp_path):
    path = "assets/demo" if app_checkpoint == "demo" else app_checkpoint
    with pytest.raises(TokenizerError, match="has no .* token: --chat needs DeepSeek-V3.2's vocabulary"):
        encode_chat(Tokenizer(path), "Hi")
    out = tmp_path / "t.safetensors"
    assert main(["run", "--checkpoint", app_checkpoint, "--prompt", "Hi", "--chat", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--chat needs DeepSeek-V3.2's vocabulary" in err[0] and not out.exists()
    assert main(["run", "--checkpoint", app_checkpoint, "--token-ids", "1,2", "--chat", "--out", str(out)]) == 2
    assert main(["run", "--checkpoint", app_checkpoint, "--prompt", "Hi", "--thinking", "--out", str(out)]) == 2
