"""``python -m tracing convert --layout v3 SRC DST``: a copy of a V3.2 checkpoint in DeepSeek-V3's
layout (model.convert), to compare dense against sparse attention on one set of weights with
``diff --checkpoint DST --against SRC``.

DST must not exist: the copy is staged beside it, read back and checked, and appears whole
(tracing.cli.output), or not at all.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from model.checkpoint import INDEX, SafetensorsSource
from model.convert import write_v3_layout

from ..errors import InputError
from .inputs import named_path
from .loading import resolve_checkpoint
from .output import Outputs, check_directory
from .progress import ProgressBar

LAYOUTS = ("v3",)


def add_parser(sub) -> None:
    conv = sub.add_parser(
        "convert", help="write a copy of a checkpoint in another family's layout (v3: DeepSeek-V3's, without the indexer)"
    )
    conv.add_argument("--layout", required=True, choices=LAYOUTS, help="v3: DeepSeek-V3's layout (V3, R1, V3.1), no indexer")
    conv.add_argument("src", type=named_path, help="the checkpoint directory to copy, or 'demo'")
    conv.add_argument("dst", type=named_path, help="the new checkpoint directory (must not exist)")
    conv.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    src = resolve_checkpoint(args.src)
    dst = check_directory(args.dst)
    if dst.exists():
        raise InputError(f"{dst}: exists; convert writes a new directory and replaces nothing")
    source = SafetensorsSource(src)
    if dst.resolve().is_relative_to(src.resolve()):
        raise InputError(f"{dst}: inside the source checkpoint {src}; choose a directory outside it")
    bar = ProgressBar(len(set(source.weight_map.values())), enabled=sys.stderr.isatty())
    started = time.perf_counter()
    try:
        with Outputs() as out:
            folder = out.directory(dst)
            converted = write_v3_layout(source, folder.staging, lambda done, n, name, nbytes: bar.update(done, name, nbytes))
            kept = len(json.loads((folder.staging / INDEX).read_text())["weight_map"])
    finally:
        bar.close()
    line = {
        "source": str(src),
        "written": str(dst),
        "layout": args.layout,
        "model_type": converted.model_type,
        "tensors": kept,
        "dropped": len(source.weight_map) - kept,
        "seconds": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(line))
    return 0
