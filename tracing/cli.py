"""python -m tracing {run, export, info, eval, diff}: see DESIGN.md for the contract.

Bad input exits with status 2 and one line on stderr naming the problem, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from model.checkpoint import CheckpointError, dtype_name, expected_specs
from model.config import ConfigError, ModelArgs
from model.params import count_params

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo"


class UsageError(ValueError):
    """Bad input from the command line."""


def resolve_checkpoint(value: str) -> Path:
    """``demo`` names the bundled checkpoint; anything else is a directory."""
    return DEMO if value == "demo" else Path(value)


def cmd_info(args: argparse.Namespace) -> int:
    if args.checkpoint:
        from model.checkpoint import SafetensorsSource

        source = SafetensorsSource(resolve_checkpoint(args.checkpoint))
        config, gate_bias = source.args, source.has_gate_bias
    else:
        config, gate_bias = ModelArgs.from_file(args.config), None
    out = count_params(config, gate_bias)
    out.update(
        n_layers=config.n_layers,
        n_dense_layers=config.n_dense_layers,
        n_moe_layers=config.n_moe_layers,
        dim=config.dim,
        vocab_size=config.vocab_size,
        n_routed_experts=config.n_routed_experts,
        n_activated_experts=config.n_activated_experts,
        index_topk=config.index_topk,
        dtype=config.dtype,
        config=config.to_reference(),
    )
    if args.tensors:
        specs = expected_specs(config, gate_bias)
        out["tensors"] = {name: [list(s.shape), dtype_name(s.dtype)] for name, s in specs.items()}
    json.dump(out, sys.stdout)
    sys.stdout.write("\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tracing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="parameter counts (and expected tensors) as JSON, from the architecture alone")
    src = info.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory, or 'demo'")
    src.add_argument("--config", help="config.json (Hugging Face) or the reference's JSON")
    info.add_argument("--tensors", action="store_true", help="add every expected tensor name with [shape, dtype]")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CheckpointError, ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
