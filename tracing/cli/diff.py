"""``python -m tracing diff``: two traces of one prompt compared (stream drift, changed experts and
keys, attention, predictions), or one prompt traced on two checkpoints that share a tokenizer and
then compared.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import InputError
from ..runner import TraceRequest
from ..trace import Trace
from .inputs import named_path, token_ids
from .loading import add_device_options, budgets_from_args, parse_device, parse_dtype, refuse_server
from .output import REUSED
from .progress import ProgressBar


def add_parser(sub) -> None:
    dif = sub.add_parser(
        "diff",
        help="compare two traces of one prompt, or one prompt on two checkpoints that share a tokenizer: stream drift, "
        "changed experts and keys, attention, predictions",
    )
    dif.add_argument("a", nargs="?", type=named_path, help="first trace (the baseline)")
    dif.add_argument("b", nargs="?", type=named_path, help="second trace")
    dif.add_argument("--checkpoint", type=named_path, metavar="A", help="instead of traces: the first checkpoint, or 'demo'")
    dif.add_argument("--against", type=named_path, metavar="B", help="with --checkpoint: the checkpoint compared with it")
    dinp = dif.add_mutually_exclusive_group()
    dinp.add_argument("--prompt", help="with --checkpoint: the text traced on both")
    dinp.add_argument("--token-ids", help="with --checkpoint: comma-separated token ids traced on both")
    dif.add_argument("--record", help="with --checkpoint: sites to record (default 'default'; logits.all is added)")
    dif.add_argument(
        "--out-dir", type=named_path, metavar="DIR", help="with --checkpoint: write a.safetensors, b.safetensors, summary.json"
    )
    dif.add_argument("--csv", type=named_path, help=f"write the comparison tables as CSV into this directory{REUSED}")
    dif.add_argument("--parquet", action="store_true", help="with --csv: Parquet files too")
    add_device_options(dif)
    refuse_server(
        dif,
        "a server holds one model, and diff compares two: trace the prompt on each with "
        "'run --server URL --out A.safetensors', then 'diff A.safetensors B.safetensors'",
    )
    dif.set_defaults(func=cmd_diff)


def cmd_diff(args: argparse.Namespace) -> int:
    from ..analyses.diff import diff_tables, summary
    from ..tables import write_tables
    from .output import check_directory

    if args.csv is not None:
        check_directory(args.csv)
    checkpoints = args.checkpoint is not None or args.against is not None
    if checkpoints:
        return _diff_checkpoints(args)
    if args.a is None or args.b is None:
        raise InputError(
            "diff compares two trace files (diff A B), or two checkpoints (--checkpoint A --against B --prompt TEXT)"
        )
    only = (("--prompt", args.prompt), ("--token-ids", args.token_ids), ("--record", args.record), ("--out-dir", args.out_dir))
    given = [flag for flag, value in only if value is not None]
    if given:
        raise InputError(f"{given[0]} applies to --checkpoint A --against B")
    a, b = Trace.load(args.a), Trace.load(args.b)
    tables = diff_tables(a, b)
    line = json.dumps(summary(a, b, tables), allow_nan=False)
    if args.csv:
        write_tables(tables, args.csv, parquet=args.parquet)
    print(line)
    return 0


DIFF_TRACES = frozenset({"a.safetensors", "b.safetensors", "summary.json"})  # what diff --out-dir holds


def _diff_checkpoints(args: argparse.Namespace) -> int:
    """``diff --checkpoint A --against B``: the prompt traced on each in turn (one model in memory),
    then the trace diff's tables (tracing.analyses.diff.trace_checkpoints)."""
    from ..analyses.diff import diff_tables, summary, trace_checkpoints
    from ..tables import stage_tables
    from .output import Outputs, check_directory

    if args.a is not None:
        raise InputError("diff compares two trace files or two checkpoints (--checkpoint A --against B), not both")
    if args.checkpoint is None or args.against is None:
        raise InputError("a checkpoint diff needs both --checkpoint A and --against B")
    if (args.prompt is None) == (args.token_ids is None):
        raise InputError("a checkpoint diff needs --prompt TEXT or --token-ids 1,2,3 (one of them)")
    if args.out_dir is not None:
        check_directory(args.out_dir)
    if args.parquet and not args.csv:
        raise InputError("--parquet applies to --csv")
    request = TraceRequest(
        prompt=args.prompt,
        token_ids=None if args.token_ids is None else token_ids(args.token_ids),
        record=args.record or "default",
    ).check()
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    draw = sys.stderr.isatty() and not args.stream  # streaming draws its own
    bars = [ProgressBar(1, enabled=draw), ProgressBar(1, enabled=draw)]

    def on_block(which: int, i: int, n: int) -> None:
        bars[which].total = n
        bars[which].update(i + 1, f"{'ab'[which]}: layers.{i}")

    try:
        a, b = trace_checkpoints(
            args.checkpoint,
            args.against,
            request,
            device=device,
            dtype=dtype,
            stream=True if args.stream else None,
            on_block=on_block,
            budgets=budgets_from_args(args),
        )
    finally:
        for bar in bars:
            bar.close()
    tables = diff_tables(a, b)
    info = {"a": a.extra.get("checkpoint"), "b": b.extra.get("checkpoint"), **summary(a, b, tables)}
    line = json.dumps(info, allow_nan=False)
    with Outputs() as out:  # the traces, the summary and the tables land together or not at all
        if args.out_dir is not None:
            folder = out.directory(args.out_dir, stale=DIFF_TRACES)
            for name, data in (("a.safetensors", a.to_bytes()), ("b.safetensors", b.to_bytes()), ("summary.json", line.encode())):
                folder.write(name, lambda path, data=data: path.write_bytes(data))
        if args.csv:
            stage_tables(out, tables, args.csv, parquet=args.parquet)
    print(line)
    return 0
