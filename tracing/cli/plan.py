"""``python -m tracing plan``: the memory each rank needs for a request, before a node is rented.

    python -m tracing plan --config assets/configs/config_671B_hf.json --ranks 8 --device-memory 141GB
    python -m tracing plan --checkpoint /data/DeepSeek-V3.2-Exp --ranks 8 --tokens 4096 --generate 64 --json

Per rank: the weights it holds, a request's caches, the forward's peak activations beside them,
the derived sites' transient memory, the trace it copies to the host, and whether a server on such
devices holds the model or streams it (with what a streamed pass reads from disk). Every figure is
counted by running the request on the meta device (tracing.plan); nothing is read or loaded.
"""

from __future__ import annotations

import argparse
import json

from ..errors import InputError
from .inputs import CONFIG_BYTES, integer, named_path, regular_file


def add_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="each rank's memory for a request (weights, caches, activations, trace), held or streamed, "
        "counted on the meta device: nothing is loaded",
    )
    src = plan.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=named_path, help="checkpoint directory (its config and tensors), or 'demo'")
    src.add_argument("--config", type=named_path, help="config.json (Hugging Face) or the reference's JSON")
    plan.add_argument("--ranks", type=integer(1, 1024), default=1, help="ranks the model is split over (default 1)")
    plan.add_argument(
        "--device-memory", metavar="SIZE", help="each device's memory, e.g. 141GB or 80GiB: decides held or streamed"
    )
    plan.add_argument("--tokens", type=integer(1), default=None, help="prompt positions (default 4096, or the model's limit)")
    plan.add_argument("--generate", type=integer(0), default=0, help="tokens generated after the prompt (default 0)")
    plan.add_argument("--record", default="default", help="site patterns the trace records (default: default)")
    plan.add_argument("--dtype", default="bfloat16", help="bfloat16 (default) or float32")
    plan.add_argument("--device", default="cuda", help="cuda (default) or cpu: the CPU keeps wider copies of FP8 weights")
    plan.add_argument("--no-mtp", action="store_true", help="leave the multi-token-prediction module out")
    plan.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the table")
    plan.set_defaults(func=cmd_plan)


def _source(args: argparse.Namespace):
    from model.checkpoint import SafetensorsSource
    from model.config import ModelArgs

    from ..plan import ConfigSource
    from .loading import resolve_checkpoint

    if args.checkpoint:
        directory = resolve_checkpoint(args.checkpoint)
        if not directory.is_dir():
            raise InputError(f"--checkpoint {args.checkpoint}: not a directory")
        return SafetensorsSource(directory)
    return ConfigSource(ModelArgs.from_file(regular_file(args.config, "config file", CONFIG_BYTES)))


def cmd_plan(args: argparse.Namespace) -> int:
    from ..plan import DEFAULT_TOKENS, GB, memory_plan, parse_memory
    from .loading import parse_dtype

    if args.device not in ("cuda", "cpu"):
        raise InputError(f"--device {args.device!r}: choose cuda or cpu")
    try:
        memory = parse_memory(args.device_memory) if args.device_memory is not None else None
    except ValueError as exc:
        raise InputError(f"--device-memory {exc}") from None
    record = [p.strip() for p in args.record.split(",") if p.strip()]
    if not record:
        raise InputError("--record names no site: give patterns like 'default' or 'layers.*.ffn.gate.*'")
    source = _source(args)
    limit = source.args.max_seq_len
    tokens = args.tokens if args.tokens is not None else max(min(DEFAULT_TOKENS, limit - args.generate), 1)
    if tokens + args.generate > limit:
        raise InputError(f"--tokens {tokens} + --generate {args.generate} exceed the {limit} positions this model takes")
    mtp = False if args.no_mtp else None
    plan = memory_plan(source, args.ranks, memory, tokens, args.generate, record, parse_dtype(args.dtype), args.device, mtp)
    if args.json:
        print(json.dumps(plan.to_json(), allow_nan=False))
        return 0
    print(f"{tokens} prompt tokens, {args.generate} generated, record {','.join(record)}; GB per rank (1 GB = 1e9 bytes)")
    head = ("rank", "weights", "caches", "activations", "derived", "device total", "trace (host)", "disk per pass")
    print("  ".join(f"{h:>12}" for h in head))
    for r in plan.ranks:
        row = (r.weights, r.caches, r.activations, r.derived, r.device, r.trace, r.disk)
        print(f"{r.rank:>12}  " + "  ".join(f"{v / GB:>12,.3f}" for v in row))
    if memory is not None:
        print(plan.headline())
        if not plan.fits:
            print(f"a request of {tokens} tokens does not fit in {memory / GB:,.1f} GB even streamed: fewer tokens or more ranks")
    return 0
