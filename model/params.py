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


def block_components(args: ModelArgs) -> tuple[dict[str, int], list[dict[str, int]]]:
    """Parameters per component outside the blocks, and inside each block. Every dense block is
    alike and so is every MoE block: a model cut after its first MoE block is built (on the meta
    device, milliseconds where the 671B model takes seconds) and its blocks stand for the rest."""
    small = args.replace(n_layers=min(args.n_layers, args.n_dense_layers + 1))
    top: Counter[str] = Counter()
    blocks: list[Counter[str]] = [Counter() for _ in range(small.n_layers)]
    for name, p in build_model(small).named_parameters():
        if name.endswith(".scale"):  # FP8 block scales are not weights
            continue
        if name.startswith("layers."):
            blocks[int(name.split(".")[1])][component(name)] += p.numel()
        else:
            top[component(name)] += p.numel()
    per_layer = [dict(blocks[min(i, len(blocks) - 1)]) for i in range(args.n_layers)]
    return dict(top), per_layer


def count_params(args: ModelArgs) -> dict[str, Any]:
    """Total and activated parameters, per component and per block."""
    top, per_layer = block_components(args)
    by_component: Counter[str] = Counter(top)
    for block in per_layer:
        by_component.update(block)
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
        "per_layer": [sum(block.values()) for block in per_layer],
    }
