"""``python -m tracing info``: a model's parameter counts (and its expected tensors) as JSON, from
its config alone: nothing is loaded.
"""

from __future__ import annotations

import argparse
import json

from model import kernels
from model.checkpoint import SafetensorsSource, dtype_name, expected_specs
from model.config import ModelArgs
from model.params import count_params

from .inputs import CONFIG_BYTES, named_path, regular_file
from .loading import resolve_checkpoint


def add_parser(sub) -> None:
    info = sub.add_parser("info", help="parameter counts (and expected tensors) as JSON, from the architecture alone")
    isrc = info.add_mutually_exclusive_group(required=True)
    isrc.add_argument("--checkpoint", type=named_path, help="checkpoint directory, or 'demo'")
    isrc.add_argument("--config", type=named_path, help="config.json (Hugging Face) or the reference's JSON")
    info.add_argument("--tensors", action="store_true", help="add every expected tensor name with [shape, dtype]")
    info.set_defaults(func=cmd_info)


def cmd_info(args: argparse.Namespace) -> int:
    if args.checkpoint:
        config = SafetensorsSource(resolve_checkpoint(args.checkpoint)).args
    else:
        config = ModelArgs.from_file(regular_file(args.config, "config file", CONFIG_BYTES))
    out = count_params(config)
    out.update(
        n_layers=config.n_layers,
        n_dense_layers=config.n_dense_layers,
        n_moe_layers=config.n_moe_layers,
        dim=config.dim,
        vocab_size=config.vocab_size,
        n_routed_experts=config.n_routed_experts,
        n_activated_experts=config.n_activated_experts,
        index_topk=config.index_topk if config.has_indexer else None,  # None: no indexer (DeepSeek-V3 layout)
        dtype=config.dtype,
        config=config.to_reference(),
        **kernels.describe(),
    )
    if args.tensors:
        specs = expected_specs(config)
        out["tensors"] = {name: [list(s.shape), dtype_name(s.dtype)] for name, s in specs.items()}
    print(json.dumps(out, allow_nan=False))
    return 0
