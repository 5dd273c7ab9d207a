"""``python -m tracing eval``: next-token NLL, perplexity, top-1 accuracy and bits per byte of a
checkpoint on a text file, with or without interventions (tracing.analyses.evaluate); over a set of
prompts (``--prompts``), each prompt's loss plain and under the interventions, and the paired
difference with its bootstrap interval (tracing.analyses.prompt_sets), here or on a model server.
"""

from __future__ import annotations

import argparse
import contextlib
import json

from ..errors import InputError
from .inputs import add_intervention_flags, intervention_spec, named_path, regular_file
from .loading import add_device_options, open_from_args, parse_device, parse_dtype
from .sets import add_set_options

WHOLE_TEXT = (  # why --text-file runs on a model loaded here only
    "eval --text-file tokenizes the whole text and scores batches of windows of it on a model loaded here, "
    "and a server traces one prompt of at most its --max-prompt-tokens at a time: give --checkpoint (or --prompts)"
)


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="next-token NLL, perplexity, top-1 accuracy and bits per byte on a text file")
    ev.add_argument("--checkpoint", type=named_path, help="checkpoint directory, or 'demo'")
    ev.add_argument("--server", metavar="URL", help="with --prompts: a model server (python -m tracing serve) runs them")
    ev.add_argument("--token-file", type=named_path, help="with --server: the file holding its bearer token")
    given = ev.add_mutually_exclusive_group(required=True)
    given.add_argument("--text-file", type=named_path, help="UTF-8 text to score")
    given.add_argument(
        "--prompts",
        type=named_path,
        metavar="FILE",
        help="a set of prompts (one a line, or JSONL with prompt): each scored plain and under the interventions, "
        "the paired difference in nats with its bootstrap interval, also past index_topk",
    )
    ev.add_argument("--csv", type=named_path, help="with --prompts: the tables eval and eval_prompts into this directory")
    ev.add_argument("--parquet", action="store_true", help="with --csv: Parquet files too")
    add_device_options(ev)
    add_intervention_flags(ev, positions=False)
    ev.add_argument(
        "--graph",
        type=named_path,
        metavar="FILE.json",
        help="with --prompts: an intervention graph (docs/graphs.md) the changed runs apply, alone or with the flags",
    )
    add_set_options(ev)
    # what the shared loader reads of the commands that take --synthetic (tracing.cli.loading.open_from_args)
    ev.set_defaults(func=cmd_eval, synthetic=None, n_layers=None)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..analyses.evaluate import evaluate

    if args.server is not None and args.text_file is not None:
        raise InputError(WHOLE_TEXT)
    if (args.server is None) == (args.checkpoint is None):
        raise InputError("give --checkpoint DIR or --server URL (one of them)")
    if args.prompts is not None:
        return _over_prompts(args)
    if args.csv is not None:
        raise InputError("--csv applies to --prompts (--text-file prints one JSON line)")
    if args.graph is not None:
        raise InputError("--graph applies to --prompts (a graph runs on one prompt at a time, not on batches of windows)")
    path = regular_file(args.text_file, "text file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the text file ({exc})") from None
    if not text.strip():
        raise InputError(f"{path}: the text file is empty")
    from ..analyses.intervention_specs import from_spec

    interventions = from_spec(intervention_spec(args))
    if any(getattr(i, "positions", None) is not None for i in interventions):
        raise InputError("eval: a removal acts at every position of every window (LAYER:ID@P applies to run)")
    if args.token_file is not None:
        raise InputError("--token-file applies to --server")
    loaded = open_from_args(args, parse_device(args.device), parse_dtype(args.dtype))
    if loaded.tokenizer is None:
        raise InputError(f"{loaded.label} has no tokenizer.json: eval needs one")
    with loaded.context() or contextlib.nullcontext():  # streamed: every batch's forward reads the blocks again
        result = evaluate(loaded.model, loaded.tokenizer, text, interventions=interventions, device=loaded.device)
    print(json.dumps(result, allow_nan=False))
    return 0


def _over_prompts(args: argparse.Namespace) -> int:
    from ..analyses.intervention_specs import from_spec
    from .sets import cmd_eval_prompts

    spec = intervention_spec(args)
    if any(getattr(i, "positions", None) is not None for i in from_spec(spec)):
        raise InputError("eval: a removal acts at every position of every prompt (LAYER:ID@P applies to run)")
    graph = None
    if args.graph is not None:
        from ..analyses.graph import Graph

        graph = Graph.load(args.graph)
    return cmd_eval_prompts(args, spec, graph)
