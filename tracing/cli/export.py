"""``python -m tracing export``: a trace's tables written as CSV (and Parquet)."""

from __future__ import annotations

import argparse

from ..trace import Trace
from .inputs import named_path
from .output import REUSED


def add_parser(sub) -> None:
    exp = sub.add_parser("export", help="write a trace's tables as CSV (and Parquet)")
    exp.add_argument("trace", type=named_path, help="trace file")
    exp.add_argument("--csv", type=named_path, required=True, help=f"output directory{REUSED}")
    exp.add_argument("--parquet", action="store_true", help="Parquet files too")
    exp.set_defaults(func=cmd_export)


def cmd_export(args: argparse.Namespace) -> int:
    from ..tables import export

    export(Trace.load(args.trace), args.csv, parquet=args.parquet)
    return 0
