"""Trace sites: the hook points' names, the values derived from them, their shapes and the defaults.

A site is named by its module path (``layers.3.ffn.gate.topk_indices``); derived sites are computed
while tracing from hook-point values and named beside them (``layers.3.attn.indexer.recall``).
"""

from __future__ import annotations

import fnmatch
import re
from functools import lru_cache

import torch

from model.config import ModelArgs
from model.hooks import HookPoint

from .errors import InputError

# recorded unless the user chooses: everything in DESIGN.md's trace table and the cheap extras
DEFAULT_PATTERNS = (
    "layers.*.resid_pre",
    "layers.*.resid_mid",
    "layers.*.resid_post",
    "layers.*.attn.indexer.scores",
    "layers.*.attn.indexer.topk_indices",
    "layers.*.attn.indexer.recall",
    "layers.*.attn.probs_mean",
    "layers.*.ffn.gate.scores",
    "layers.*.ffn.gate.biased_scores",
    "layers.*.ffn.gate.group_scores",
    "layers.*.ffn.gate.groups",
    "layers.*.ffn.gate.topk_indices",
    "layers.*.ffn.gate.topk_weights",
    "logits.last",
)
# the logit lens costs a head product per block (more than the forward of a small model): on request
LOGIT_LENS = "layers.*.logit_lens.*"

# derived sites: name suffix -> (shape legend, dtype, what it is)
DERIVED = {
    "attn.indexer.recall": ("T", torch.float32, "share of the dense attention mass (mean over heads) on the selected keys"),
    "attn.probs_mean": ("T S", torch.float32, "attention probabilities after the sparse mask, mean over heads"),
    "logit_lens.topk_indices": ("T L", torch.int64, "top tokens of final norm + head applied to resid_post"),
    "logit_lens.topk_probs": ("T L", torch.float32, "their probabilities"),
}
LOGIT_LENS_TOPK = 5
INDEX_SITES = ("topk_indices", "groups", "logit_lens.topk_indices")  # integer-valued sites


def hook_points(model: torch.nn.Module) -> dict[str, HookPoint]:
    return {name: m for name, m in model.named_modules() if isinstance(m, HookPoint)}


@lru_cache(maxsize=16)
def _site_shapes_cached(args: ModelArgs, with_bias: bool) -> dict[str, tuple[str, torch.dtype]]:
    from model.checkpoint import build_model

    # every dense block has the same hook points, and so has every MoE block: a model cut after
    # its first MoE block names them all (building the 671B model on meta takes seconds)
    small = args.replace(n_layers=min(args.n_layers, args.n_dense_layers + 1))
    template: dict[int, list[tuple[str, str, torch.dtype]]] = {}
    out: dict[str, tuple[str, torch.dtype]] = {}
    for name, point in hook_points(build_model(small, gate_bias=with_bias)).items():
        dtype = torch.int64 if name.endswith(("topk_indices", ".groups")) else torch.float32
        m = re.match(r"layers\.(\d+)\.(.*)", name)
        if m is None:
            out[name] = (point.shape, dtype)
        else:
            template.setdefault(int(m.group(1)), []).append((m.group(2), point.shape, dtype))
    for i in range(args.n_layers):
        for suffix, legend, dtype in template[min(i, small.n_layers - 1)]:
            out[f"layers.{i}.{suffix}"] = (legend, dtype)
        for suffix, (legend, dtype, _) in DERIVED.items():
            out[f"layers.{i}.{suffix}"] = (legend, dtype)
    return out


def site_shapes(args: ModelArgs) -> dict[str, tuple[str, torch.dtype]]:
    """Every site name of a model of this config -> (shape legend, recorded dtype)."""
    return _site_shapes_cached(args, True)


def dims(args: ModelArgs, name: str, n_tokens: int) -> dict[str, int]:
    """Sizes of the letters in a site's shape legend, for a prefill of ``n_tokens``."""
    indexer = ".indexer." in name
    return {
        "B": 1,
        "T": n_tokens,
        "N": n_tokens,
        "S": n_tokens,
        "D": args.dim,
        "H": args.index_n_heads if indexer else args.n_heads,
        "K": min(args.index_topk, n_tokens),
        "E": args.n_routed_experts,
        "G": args.n_expert_groups,
        "k": args.n_activated_experts,
        "topk_groups": args.n_limited_groups,
        "V": args.vocab_size,
        "L": LOGIT_LENS_TOPK,
    }


def site_shape(args: ModelArgs, name: str, legend: str, n_tokens: int) -> tuple[int, ...]:
    """The recorded shape (batch dropped) of a site."""
    sizes = dims(args, name, n_tokens)
    return tuple(sizes[letter] for letter in legend.split() if letter != "B")


def select(args: ModelArgs, patterns: str | tuple[str, ...] | list[str] | None) -> list[str]:
    """Site names matching glob patterns (``*`` crosses dots); 'default' and 'all' are shorthands.

    Raises InputError for a pattern that matches nothing, so typos do not silently record nothing.
    """
    names = list(site_shapes(args))
    if patterns is None or patterns == "default":
        patterns = DEFAULT_PATTERNS
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    chosen: list[str] = []
    for pattern in patterns:
        if pattern == "default":
            matched = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in DEFAULT_PATTERNS)]
        elif pattern == "all":
            matched = names
        else:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                raise InputError(f"--record pattern {pattern!r} matches no trace site (e.g. layers.*.ffn.gate.*)")
        chosen.extend(m for m in matched if m not in chosen)
    return sorted(chosen, key=site_order)


def site_order(name: str) -> tuple:
    m = re.match(r"layers\.(\d+)\.(.*)", name)
    return (0, int(m.group(1)), m.group(2)) if m else (1, 0, name)


def estimate_bytes(args: ModelArgs, names: list[str], n_tokens: int) -> int:
    """The trace's size before the run: the recorded tensors' bytes."""
    shapes = site_shapes(args)
    total = 0
    for name in names:
        legend, dtype = shapes[name]
        n = 1
        for size in site_shape(args, name, legend, n_tokens):
            n *= size
        total += n * dtype.itemsize
    return total + n_tokens * 8
