"""``python -m tracing atlas``: its arguments and its command (tracing.cli registers them)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ..errors import InputError
from .inputs import add_intervention_flags, finite, integer, intervention_spec, named_path
from .loading import add_device_options, add_source_options, refuse_server


def add_parser(sub) -> None:
    atlas = sub.add_parser(
        "atlas",
        help="count routing and sparse attention over a corpus: expert load, co-activation, specialisation, "
        "bias effect, indexer reach, recall and sinks (Parquet tables and summary.json)",
    )
    add_source_options(atlas, "synthetic weights of this config (needs --tokenizer)")
    refuse_server(
        atlas,
        "the atlas counts routing and attention with hooks on batches of a corpus on a model loaded here "
        "(under torchrun, split over the ranks with --parallel model), not one traced request at a time: give --checkpoint",
    )
    atlas.add_argument(
        "--tokenizer", type=named_path, metavar="DIR", help="with --synthetic: a directory with tokenizer.json, or 'demo'"
    )
    texts = atlas.add_mutually_exclusive_group()
    texts.add_argument("--text-file", type=named_path, action="append", metavar="F", help="a UTF-8 text file (repeat for more)")
    texts.add_argument(
        "--jsonl", type=named_path, action="append", metavar="F", help="JSON Lines, one text per record (repeat for more)"
    )
    atlas.add_argument("--field", default="text", help="with --jsonl: the field that holds the text (default text)")
    atlas.add_argument(
        "--out", type=named_path, required=True, metavar="DIR", help="the atlas directory (tables, summary.json, checkpoint)"
    )
    atlas.add_argument(
        "--seq-len", type=integer(), help="positions per sequence, BOS included (default 512, at most the model's limit)"
    )
    atlas.add_argument("--batch-size", type=integer(), default=4, help="sequences per forward pass (default 4)")
    atlas.add_argument("--max-tokens", type=integer(), metavar="N", help="stop after N positions of the corpus")
    add_device_options(atlas)
    atlas.add_argument(
        "--parallel",
        choices=("data", "model"),
        default="data",
        help="under torchrun: each rank runs its share of the batches with the whole model (data, default), "
        "or every rank runs every batch with the model split over the ranks (model: tensor and expert parallel)",
    )
    atlas.add_argument(
        "--model-ranks",
        type=integer(),
        metavar="M",
        help="with --parallel model: split the model over groups of M consecutive ranks (a node's GPUs) and share "
        "the batches between the groups (nodes); default: every rank in one group",
    )
    atlas.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out (no batch counted twice)")
    atlas.add_argument(
        "--checkpoint-every", type=finite, default=300.0, metavar="SECONDS", help="write the checkpoint this often (default 300)"
    )
    atlas.add_argument(
        "--min-count", type=integer(), default=5, help="fewest occurrences of a token (or expert-token pair) to rank"
    )
    add_intervention_flags(atlas, positions=False)
    atlas.set_defaults(func=cmd_atlas)


def cmd_atlas(args: argparse.Namespace) -> int:
    from ..analyses.intervention_specs import from_spec
    from ..atlas import AtlasJob
    from ..atlas.build import shard_fingerprint
    from ..atlas.corpus import Source
    from ..tokenizer import Tokenizer
    from .loading import (
        corpus_checkpoint,
        open_from_args,
        parse_device,
        parse_dtype,
        synthetic_with_tokenizer,
    )

    interventions = tuple(from_spec(intervention_spec(args)))
    if any(getattr(i, "positions", None) is not None for i in interventions):
        raise InputError("atlas: a removal acts at every position of every sequence (LAYER:ID@P applies to run)")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    if args.checkpoint_every < 0:
        raise InputError(f"--checkpoint-every {args.checkpoint_every}: must be 0 or more seconds")
    weights = None
    sources = [Source(Path(f)) for f in args.text_file or ()] + [Source(Path(f), args.field) for f in args.jsonl or ()]
    if args.synthetic:
        config, tokenizer_dir = synthetic_with_tokenizer(args)
        tokenizer, label = Tokenizer(tokenizer_dir), f"synthetic:{args.synthetic}"
    else:
        for flag in ("n_layers", "tokenizer"):
            if getattr(args, flag) is not None:
                raise InputError(f"--{flag.replace('_', '-')} applies to --synthetic only")
        directory, config, label = corpus_checkpoint(args.checkpoint, "the atlas")
        tokenizer, weights = Tokenizer(directory), shard_fingerprint(directory)
    job = AtlasJob(
        sources,
        tokenizer,
        config,
        args.out,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        min_count=args.min_count,
        label=label,
        resume=args.resume,
        weights=weights,
        interventions=interventions,
    )
    group = None
    if args.model_ranks is not None:
        if args.parallel != "model":
            raise InputError("--model-ranks applies to --parallel model")
        from model import parallel

        distributed = parallel.init_distributed(device)
        world = distributed.world if distributed is not None else 1
        if args.model_ranks < 1 or world % args.model_ranks:
            raise InputError(f"--model-ranks {args.model_ranks}: the {world} ranks do not split into groups of that size")
        if distributed is not None and args.model_ranks < world:
            group, leaders, _ = parallel.model_groups(args.model_ranks)
            job.leaders = leaders
    loaded = open_from_args(args, device, dtype, split=args.parallel == "model", group=group)
    draw = int(os.environ.get("RANK", "0")) == 0 and sys.stderr.isatty()
    job.run(loaded, checkpoint_every=args.checkpoint_every, progress=draw)
    return 0
