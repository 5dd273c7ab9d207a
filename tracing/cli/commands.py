"""python -m tracing {run, diff, export, info, eval, atlas, dictionary, patching, plan, serve, convert}: the command
line of docs/architecture.md (Contracts).

Bad input exits with status 2 and one line on stderr naming the problem, never a traceback, and
leaves no partial output file behind (outputs are written to a temporary name, then renamed); so
does an output that cannot be written (tracing.cli.output).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys

from model import fp8, kernels
from model.checkpoint import CheckpointError
from model.config import ConfigError

from ..errors import InputError
from ..tokenizer import TokenizerError
from ..trace import TraceError
from . import atlas, convert, dictionary, diff, export, info, patching, plan, run, serve
from . import eval as evaluate
from .inputs import Parser

BAD_INPUT = (CheckpointError, ConfigError, InputError, TraceError, TokenizerError)


def _leave_process_group() -> None:
    """Under torchrun: wait for every rank (rank 0 may still be writing), then close the group, so
    no communication thread outlives the interpreter (that aborts the process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m tracing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (
        run,
        diff,
        export,
        info,
        evaluate,
        atlas,
        dictionary,
        patching,
        plan,
        serve,
        convert,
    ):  # the order --help lists them in
        command.add_parser(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that what it was writing is removed as on Ctrl-C."""


def _on_term(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    try:
        previous = signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread: the caller handles its signals
        previous = None
    try:
        args = build_parser().parse_args(argv)
        whole_k = fp8.inexact_sums() if getattr(args, "inexact_fp8_sums", False) else contextlib.nullcontext()
        with kernels.serial_passes(), whole_k:  # a CPU forward's passes on one thread, large products on all
            return args.func(args)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _leave_process_group()
