"""``python -m tracing dictionary features``: the feature pages of dictionaries over a corpus
(tracing.dictionary.pages), written as CSV (and Parquet) tables."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import InputError
from .inputs import integer, named_path
from .loading import add_device_options, add_source_options, refuse_server


def add_parser(actions) -> None:
    pages = actions.add_parser(
        "features",
        help="feature pages over a corpus: each feature's strongest contexts, the tokens it promotes and suppresses, "
        "the experts its positions are routed to against the base rates, how often the indexer keeps them; "
        "per expert the features it carries (CSV/Parquet tables)",
    )
    add_source_options(pages, "synthetic weights of this config (needs --tokenizer)")
    refuse_server(pages, "feature pages read the dictionaries' inputs with hooks on batches of a corpus: give --checkpoint")
    pages.add_argument(
        "--tokenizer", type=named_path, metavar="DIR", help="with --synthetic: a directory with tokenizer.json, or 'demo'"
    )
    pages.add_argument(
        "--dictionary",
        type=named_path,
        action="append",
        required=True,
        metavar="DIR",
        help="a dictionary directory (cfg.json, sae_weights.safetensors); repeat for more, each named by its directory",
    )
    texts = pages.add_mutually_exclusive_group(required=True)
    texts.add_argument("--text-file", type=named_path, action="append", metavar="F", help="a UTF-8 text file (repeat for more)")
    texts.add_argument("--jsonl", type=named_path, action="append", metavar="F", help="JSON Lines, one text per record (repeat)")
    pages.add_argument("--field", default="text", help="with --jsonl: the field that holds the text (default text)")
    pages.add_argument("--seq-len", type=integer(2), default=256, help="positions per sequence, BOS included (default 256)")
    pages.add_argument("--batch-size", type=integer(1), default=4, help="sequences per forward pass (default 4)")
    pages.add_argument(
        "--max-tokens", type=integer(2), default=65536, metavar="N", help="read at most N positions (default 65536)"
    )
    pages.add_argument("--contexts", type=integer(1, 1000), default=10, help="strongest contexts kept per feature (default 10)")
    pages.add_argument("--window", type=integer(1, 1000), default=8, help="tokens shown either side of a context (default 8)")
    pages.add_argument(
        "--logit-tokens", type=integer(1, 1000), default=10, help="tokens promoted and suppressed per feature (default 10)"
    )
    pages.add_argument("--out", type=named_path, required=True, metavar="DIR", help="directory for the tables")
    pages.add_argument("--parquet", action="store_true", help="Parquet files beside the CSV")
    add_device_options(pages)
    pages.set_defaults(func=cmd_features)


def cmd_features(args: argparse.Namespace) -> int:
    from ..atlas.corpus import Corpus, Source
    from ..dictionary import check_fits, load
    from ..dictionary.pages import PageSettings, feature_pages
    from ..tables import write_tables
    from ..tokenizer import Tokenizer
    from .loading import open_from_args, parse_device, parse_dtype, resolve_checkpoint, synthetic_with_tokenizer
    from .output import check_directory
    from .progress import ProgressBar

    check_directory(args.out)
    settings = PageSettings(contexts=args.contexts, window=args.window, logit_tokens=args.logit_tokens).check()
    if args.synthetic:
        config, tokenizer_dir = synthetic_with_tokenizer(args)
    else:
        from model.checkpoint import SafetensorsSource

        if args.tokenizer is not None or args.n_layers is not None:
            raise InputError("--tokenizer and --n-layers apply to --synthetic")
        tokenizer_dir = resolve_checkpoint(args.checkpoint)
        config = SafetensorsSource(tokenizer_dir).args  # the config alone: weights load once the inputs are checked
    if args.seq_len > config.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len}: this model takes at most {config.max_seq_len} positions")
    named = {}
    for directory in args.dictionary:
        name = Path(directory).resolve().name
        if name in named:
            raise InputError(f"two dictionaries named {name!r}: a page names each by its directory")
        named[name] = load(directory)
        check_fits(named[name], config)  # before the model loads
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise InputError(f"{tokenizer_dir} has no tokenizer.json: feature pages read text")
    tokenizer = Tokenizer(tokenizer_dir)
    sources = [Source(Path(f)) for f in args.text_file or ()] + [Source(Path(f), args.field) for f in args.jsonl or ()]
    corpus = Corpus(sources, tokenizer, args.seq_len, args.batch_size, args.max_tokens)
    survey = corpus.survey()  # every input read and checked before the model loads
    loaded = open_from_args(args, parse_device(args.device), parse_dtype(args.dtype))
    if loaded.tokenizer is None:
        loaded.tokenizer = tokenizer
    bar = ProgressBar(survey.batches, enabled=sys.stderr.isatty())
    tables = feature_pages(loaded, named, corpus.batches(), settings, lambda done: bar.update(done, "batches"))
    bar.close()
    write_tables(tables, args.out, parquet=args.parquet)
    alive = tables["feature_summary"]
    print(
        f"feature pages of {len(named)} dictionar{'y' if len(named) == 1 else 'ies'} over {survey.tokens:,} positions: "
        f"{int((alive['active_positions'] > 0).sum())} of {len(alive)} features active; tables in {args.out}",
        file=sys.stderr,
    )
    return 0
