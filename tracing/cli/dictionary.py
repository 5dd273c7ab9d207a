"""``python -m tracing dictionary train``: a sparse dictionary (TopK autoencoder or transcoder) trained
on a site's values over a corpus (tracing.dictionary.train), written in SAELens's format."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import InputError
from . import feature_pages
from .inputs import finite, integer, named_path
from .loading import add_device_options, add_source_options, refuse_local_flags


def add_parser(sub) -> None:
    group = sub.add_parser("dictionary", help="sparse dictionaries over a site: train one (SAELens's format)")
    actions = group.add_subparsers(dest="action", required=True)
    _add_train(actions)
    feature_pages.add_parser(actions)


def _add_train(actions) -> None:
    train = actions.add_parser(
        "train",
        help="train a TopK sparse autoencoder on a residual site, or a transcoder on a block's FFN, over a corpus; "
        "report variance explained, L0, dead features and the spliced next-token loss on held-out text",
    )
    add_source_options(train, "synthetic weights of this config (needs --tokenizer)", server=True)
    train.add_argument(
        "--tokenizer", type=named_path, metavar="DIR", help="with --synthetic or --server: tokenizer.json's directory, or 'demo'"
    )
    texts = train.add_mutually_exclusive_group(required=True)
    texts.add_argument("--text-file", type=named_path, action="append", metavar="F", help="a UTF-8 text file (repeat for more)")
    texts.add_argument("--jsonl", type=named_path, action="append", metavar="F", help="JSON Lines, one text per record (repeat)")
    train.add_argument("--field", default="text", help="with --jsonl: the field that holds the text (default text)")
    train.add_argument(
        "--site",
        required=True,
        help="what the dictionary reads: layers.{i}.resid_post (or resid_pre, resid_mid, attn_out, ffn_out) for an "
        "autoencoder, layers.{i}.ffn (the FFN's normed input, predicting its output) for a transcoder",
    )
    train.add_argument(
        "--kind", choices=("sae", "transcoder"), help="sae or transcoder (default: transcoder for layers.{i}.ffn, sae otherwise)"
    )
    train.add_argument("--features", type=integer(1), required=True, metavar="N", help="the dictionary's width")
    train.add_argument("--k", type=integer(1), required=True, help="features active per position (TopK)")
    train.add_argument(
        "--out", type=named_path, required=True, metavar="DIR", help="cfg.json, sae_weights.safetensors, report.json"
    )
    train.add_argument("--seed", type=integer(0), default=0, help="initialisation and shuffling (default 0)")
    train.add_argument("--lr", type=finite, help="Adam's learning rate (default 2e-4 / sqrt(features / 2^14))")
    train.add_argument("--epochs", type=integer(1), default=1, help="passes over the training text (default 1)")
    train.add_argument("--rows-per-step", type=integer(1), default=1024, help="positions per optimiser step (default 1024)")
    train.add_argument(
        "--seq-len", type=integer(2), help="positions per sequence, BOS included (default 256, at most the model's)"
    )
    train.add_argument("--batch-size", type=integer(1), default=8, help="sequences per forward pass (default 8)")
    train.add_argument("--max-tokens", type=integer(2), metavar="N", help="read at most N positions of the corpus")
    train.add_argument(
        "--heldout", type=finite, default=0.1, help="share of the corpus's batches held out for the report (default 0.1)"
    )
    train.add_argument(
        "--buffer-mb", type=finite, default=256.0, help="the activation buffer's size on disk in MiB (default 256)"
    )
    train.add_argument("--aux-k", type=integer(1), help="dead features in the auxiliary loss (default 2 k)")
    train.add_argument(
        "--dead-tokens",
        type=integer(1),
        default=100_000,
        help="a feature silent for this many positions is dead (default 100000)",
    )
    add_device_options(train)
    train.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from ..atlas.build import shard_fingerprint
    from ..atlas.corpus import Source
    from ..dictionary.train import Settings, TrainJob
    from ..tokenizer import Tokenizer
    from .loading import (
        corpus_checkpoint,
        open_from_args,
        parse_device,
        parse_dtype,
        resolve_checkpoint,
        synthetic_with_tokenizer,
    )

    if not 0 < args.buffer_mb <= 1 << 20:
        raise InputError(f"--buffer-mb {args.buffer_mb}: between 0 and 1048576")
    settings = Settings(
        site=args.site,
        kind=args.kind or ("transcoder" if args.site.endswith(".ffn") else "sae"),
        features=args.features,
        k=args.k,
        seed=args.seed,
        lr=args.lr,
        rows_per_step=args.rows_per_step,
        epochs=args.epochs,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        heldout=args.heldout,
        buffer_bytes=int(args.buffer_mb * 2**20),
        aux_k=args.aux_k,
        dead_tokens=args.dead_tokens,
    )
    settings.check()
    sources = [Source(Path(f)) for f in args.text_file or ()] + [Source(Path(f), args.field) for f in args.jsonl or ()]
    weights, model = None, None
    if args.token_file is not None and args.server is None:
        raise InputError("--token-file applies to --server")
    if args.server is not None:
        from model.config import ModelArgs

        from ..client import Client, read_token_file
        from ..dictionary.sources import SERVER_TRANSCODER

        refuse_local_flags(args)
        if settings.kind == "transcoder":
            raise InputError(SERVER_TRANSCODER)
        if args.tokenizer is None:
            raise InputError("--server: pass --tokenizer DIR (the served checkpoint's tokenizer.json directory) to cut the texts")
        tokenizer, label = Tokenizer(resolve_checkpoint(args.tokenizer)), args.server
        model = Client(args.server, read_token_file(args.token_file))
        config = ModelArgs.from_json(model.info()["config"])
    elif args.synthetic:
        config, tokenizer_dir = synthetic_with_tokenizer(args)
        tokenizer, label = Tokenizer(tokenizer_dir), f"synthetic:{args.synthetic}"
    else:
        if args.tokenizer is not None or args.n_layers is not None:
            raise InputError("--tokenizer and --n-layers apply to --synthetic (and --tokenizer to --server)")
        directory, config, label = corpus_checkpoint(args.checkpoint, "training")
        tokenizer, weights = Tokenizer(directory), shard_fingerprint(directory)
    job = TrainJob(sources, tokenizer, config, args.out, settings, label=label, weights=weights)
    if model is None:
        model = open_from_args(args, parse_device(args.device), parse_dtype(args.dtype))
    report = job.run(model, progress=sys.stderr.isatty())
    print(json.dumps({k: v for k, v in report.items() if k not in ("texts", "settings")}, allow_nan=False))
    return 0
