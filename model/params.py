"""Parameter counts from the architecture alone (the model built on the meta device).

Counts are of weights, not of FP8 block scales. "Activated" is what one token touches: everything
but the embedding table and the routed experts it was not sent to.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from .checkpoint import build_model
from .config import ModelArgs

# component of a parameter inside a block, from its module path (first match wins)
_BLOCK_COMPONENTS = (
    (".attn.indexer.", "indexer"),
    (".attn.", "attention"),
    (".ffn.gate.", "router"),
    (".ffn.experts.", "routed_experts"),
    (".ffn.shared_experts.", "shared_experts"),
    (".ffn.", "dense_mlp"),
    ("_norm.", "block_norms"),
)
_TOP_COMPONENTS = {"embed": "embedding", "head": "head", "norm": "final_norm"}


def component(name: str) -> str:
    """The component a parameter belongs to: embedding, attention, indexer, router, ..."""
    top = name.split(".", 1)[0]
    if top in _TOP_COMPONENTS:
        return _TOP_COMPONENTS[top]
    return next((label for key, label in _BLOCK_COMPONENTS if key in name), "other")


def count_params(args: ModelArgs, gate_bias: bool | None = None) -> dict[str, Any]:
    """Total and activated parameters, per component and per block."""
    model = build_model(args, gate_bias=gate_bias)
    by_component: Counter[str] = Counter()
    per_layer = [0] * args.n_layers
    for name, p in model.named_parameters():
        if name.endswith(".scale"):
            continue
        by_component[component(name)] += p.numel()
        if name.startswith("layers."):
            per_layer[int(name.split(".")[1])] += p.numel()
    total = sum(by_component.values())
    expert = args.dim * args.moe_inter_dim * 3
    inactive = (args.n_routed_experts - args.n_activated_experts) * expert * args.n_moe_layers
    activated = total - by_component["embedding"] - inactive
    return {
        "total_params": total,
        "activated_params": activated,
        "activated_params_with_embedding": activated + by_component["embedding"],
        "params_per_expert": expert,
        "components": dict(sorted(by_component.items())),
        "per_layer": per_layer,
    }
