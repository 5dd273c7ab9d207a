"""A tiny checkpoint with a tokenizer, for the app's tests and benchmark when the bundled demo is absent.

It goes through the same loader as every other checkpoint: random weights of ``model.TINY`` (every
mechanism of the real model, three blocks) saved in the Hugging Face layout, plus a byte-level BPE
tokenizer trained on a few sentences (vocabulary at most the model's 512).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tracing.cli.loading import DEMO

SENTENCES = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. ",
    "The quick brown fox jumps over the lazy dog while sparse attention picks the keys that matter. ",
    "Python is an easy to learn, powerful programming language with efficient high-level data structures. ",
    "Each token is routed to a few experts; the router adds a bias only to choose them. ",
]


def demo_available() -> bool:
    return (DEMO / "config.json").is_file()


def train_tokenizer(directory: str | os.PathLike, texts: list[str], vocab_size: int, special_tokens: list[str]) -> Path:
    """A byte-level BPE ``tokenizer.json`` trained on ``texts``, written into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    path = Path(directory) / "tokenizer.json"
    tok.save(str(path))
    return path


def make_dev_checkpoint(directory: str | os.PathLike, seed: int = 1, v3: bool = False) -> Path:
    """Write the tiny checkpoint into ``directory`` (created; must not exist or be empty); ``v3``:
    in DeepSeek-V3's layout, without the indexer (model.synthetic.v3_layout)."""
    import tempfile

    from model import TINY
    from model.checkpoint import expected_specs, hf_state_dict, load_model, save_checkpoint
    from model.synthetic import SyntheticSource, v3_layout

    directory = Path(directory)
    args = TINY.replace(bos_token_id=0, eos_token_id=1)
    args = v3_layout(args) if v3 else args
    model = load_model(SyntheticSource(args, seed=seed))
    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(tmp, [s * 8 for s in SENTENCES], args.vocab_size, ["<bos>", "<eos>"])
        config = {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config))
        files = {name: Path(tmp) / name for name in ("tokenizer.json", "tokenizer_config.json")}
        tensors = hf_state_dict(model)
        if v3:  # V3's norm gains are stored in bfloat16 (exact: they were drawn so)
            specs = expected_specs(args)
            tensors = {name: t.to(specs[name].dtype) for name, t in tensors.items()}
        return save_checkpoint(tensors, args, directory, n_shards=2, extra_files=files)


def demo_or_dev_checkpoint(scratch: str | os.PathLike) -> str:
    """'demo' when the bundled demo exists, else a dev checkpoint made once under ``scratch``."""
    if demo_available():
        return "demo"
    directory = Path(scratch) / "dev-checkpoint"
    if not (directory / "config.json").is_file():
        make_dev_checkpoint(directory)
    return str(directory)
