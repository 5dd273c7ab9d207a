"""``python -m tracing eval``: next-token NLL, perplexity, top-1 accuracy and bits per byte of a
checkpoint on a text file, with or without interventions (tracing.analyses.evaluate).
"""

from __future__ import annotations

import argparse
import json

from ..errors import InputError
from .inputs import add_intervention_flags, intervention_spec, named_path, regular_file
from .loading import open_checkpoint, parse_device, parse_dtype, refuse_server


def add_parser(sub) -> None:
    ev = sub.add_parser("eval", help="next-token NLL, perplexity, top-1 accuracy and bits per byte on a text file")
    ev.add_argument("--checkpoint", type=named_path, required=True, help="checkpoint directory, or 'demo'")
    ev.add_argument("--text-file", type=named_path, required=True, help="UTF-8 text to score")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--dtype", default="bfloat16")
    add_intervention_flags(ev, positions=False)
    refuse_server(
        ev,
        "eval tokenizes the whole text and scores batches of windows of it on a model loaded here, "
        "and a server traces one prompt of at most its --max-prompt-tokens at a time: give --checkpoint",
    )
    ev.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    from ..analyses.evaluate import evaluate

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
    loaded = open_checkpoint(args.checkpoint, parse_device(args.device), parse_dtype(args.dtype))
    if loaded.tokenizer is None:
        raise InputError(f"{loaded.label} has no tokenizer.json: eval needs one")
    print(json.dumps(evaluate(loaded.model, loaded.tokenizer, text, interventions=interventions), allow_nan=False))
    return 0
