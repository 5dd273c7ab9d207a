"""What the command line accepts as a number or an input file: one rule each, used by every flag.

Python's ``int()`` and ``float()`` accept more than a flag should: ``str.isdigit`` is true for
'²', which ``int()`` refuses (a traceback where a parser said yes), and ``float()`` takes 'inf'
and 'nan', which then fail far from the flag or end up as non-standard JSON. An input file may be
a FIFO or a device (``/dev/zero``) that reads forever: only regular files are read, and a bounded
number of bytes where the file is small by nature (a config).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import stat
from pathlib import Path

from ..errors import InputError

_INTEGER = re.compile(r"[+-]?[0-9]{1,19}")  # ASCII digits only; 19 digits hold every int64
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
INT64 = (-(2**63), 2**63 - 1)
CONFIG_BYTES = 1 << 20  # a config.json is a few KB; more is not one


def parse_int(text: str, what: str, low: int = INT64[0], high: int = INT64[1]) -> int:
    """``text`` as an integer in low..high, ASCII digits only; InputError naming ``what`` otherwise."""
    text = text.strip()
    if not _INTEGER.fullmatch(text):
        raise InputError(f"{what} {text!r}: expected an integer")
    value = int(text)
    if not low <= value <= high:
        raise InputError(f"{what} {text}: must be between {low} and {high}")
    return value


def is_int(text: str) -> bool:
    """Whether ``text`` is an integer :func:`parse_int` reads (ASCII digits, int64)."""
    return bool(_INTEGER.fullmatch(text.strip())) and INT64[0] <= int(text) <= INT64[1]


def parse_float(text: str, what: str) -> float:
    """``text`` as a finite float: no 'inf', 'nan' or digits beyond ASCII."""
    text = text.strip()
    if not _FLOAT.fullmatch(text) or not math.isfinite(value := float(text)):
        raise InputError(f"{what} {text!r}: expected a finite number")
    return value


def integer(low: int = INT64[0], high: int = INT64[1]):
    """An argparse ``type`` for integers in low..high."""

    def parse(text: str) -> int:
        try:
            return parse_int(text, "", low, high)
        except InputError as exc:
            raise argparse.ArgumentTypeError(str(exc).strip()) from None

    parse.__name__ = "integer"
    return parse


def finite(text: str) -> float:
    """An argparse ``type`` for finite floats."""
    try:
        return parse_float(text, "")
    except InputError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None


def named_path(text: str) -> str:
    """An argparse ``type`` for a file or directory: an empty one (an unset variable in
    ``--out "$DIR"``) would be the current directory, or read as "not given"."""
    if not text:
        raise argparse.ArgumentTypeError("an empty path names no file or directory")
    return text


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are InputErrors: the command line's one line and status 2,
    not argparse's usage block (its subcommands' parsers are of this class too)."""

    def error(self, message: str):
        raise InputError(f"{self.prog}: {message}")


def token_ids(text: str, flag: str = "--token-ids") -> list[int]:
    """A flag's comma-separated token ids."""
    parts = [part for part in text.split(",") if part.strip()]
    if not all(is_int(part) for part in parts):
        raise InputError(f"{flag} {text!r}: expected comma-separated integers like 1,2,3")
    ids = [int(part) for part in parts]
    if not ids:
        raise InputError(f"{flag} is empty: nothing to trace")
    return ids


def regular_file(path: str | os.PathLike, what: str, limit: int | None = None, mapped: bool = False) -> Path:
    """``path`` when it is a regular file (after symlinks) of at most ``limit`` bytes; a FIFO or a
    device would read forever or block, a directory is not read at all. A ``mapped`` file
    (safetensors) must hold bytes: a /proc file is regular but empty, and cannot be mapped."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise InputError(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: not a regular file (a FIFO or device?): refusing to read it as a {what}")
    if mapped and st.st_size == 0:
        raise InputError(f"{path}: empty (or a /proc file, which cannot be mapped): not a {what}")
    if limit is not None and st.st_size > limit:
        raise InputError(f"{path}: {st.st_size:,} bytes, more than a {what} can hold ({limit:,})")
    return path


def intervention_spec(args: argparse.Namespace) -> dict:
    """The interventions the flags ask for (add_intervention_flags), as from_spec reads them."""
    if args.dense_attention and args.index_topk is not None:
        raise InputError("--dense-attention and --index-topk exclude each other")
    spec = {
        "ablate": args.ablate_experts or "",
        "zero_experts": args.zero_experts or "",
        "ablate_heads": args.ablate_heads or "",
        "no_bias": "all" if args.no_gate_bias else None,
        "attention": "dense" if args.dense_attention else args.index_topk,
        "no_act_fp8": args.no_act_fp8,
    }
    return {key: value for key, value in spec.items() if value}


def add_intervention_flags(parser, positions: bool = True) -> None:
    """--ablate-experts, --zero-experts, --ablate-heads (at ``positions`` too), --no-gate-bias,
    --dense-attention, --index-topk, --no-act-fp8: one set of flags for every command that runs the model."""
    at = "[@P|@A:B]" if positions else ""  # the positions where a removal acts (default: every position)
    parser.add_argument("--ablate-experts", metavar=f"LAYER:EXPERT{at},...", help="experts never chosen (routed around)")
    parser.add_argument("--zero-experts", metavar=f"LAYER:EXPERT{at},...", help="experts still chosen that contribute nothing")
    parser.add_argument("--ablate-heads", metavar=f"LAYER:HEAD{at},...", help="attention heads whose output is zero before wo")
    parser.add_argument("--no-gate-bias", action="store_true", help="route without the correction bias")
    parser.add_argument("--dense-attention", action="store_true", help="the indexer selects every visible key")
    parser.add_argument("--index-topk", type=integer(), help="a different index_topk for the sparse attention")
    parser.add_argument(
        "--no-act-fp8", action="store_true", help="FP8 products take their activations unrounded (the weights stay FP8)"
    )
