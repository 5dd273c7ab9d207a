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


Site = tuple[str, torch.dtype]  # (shape legend, recorded dtype)
_LAYER_SITE = re.compile(r"layers\.(0|[1-9][0-9]{0,8})\.(.+)")  # canonical block indices only: one name per site


@lru_cache(maxsize=1)
def _templates() -> tuple[dict[str, Site], dict[str, Site], dict[str, Site]]:
    """(model-level sites, a dense block's, a MoE block's). A block's hook points depend on its kind
    only, never on a size: a two-block model of the tiny config names them all, so reading the sites
    of a config costs the same for 3 blocks of 16 experts as for 2 million blocks of 262,144."""
    from model.checkpoint import build_model
    from model.config import TINY

    top: dict[str, Site] = {}
    blocks: dict[int, dict[str, Site]] = {0: {}, 1: {}}
    for name, point in hook_points(build_model(TINY.replace(n_layers=2, n_dense_layers=1), gate_bias=True)).items():
        dtype = torch.int64 if name.endswith(("topk_indices", ".groups")) else torch.float32
        m = _LAYER_SITE.fullmatch(name)
        if m is None:
            top[name] = (point.shape, dtype)
        else:
            blocks[int(m.group(1))][m.group(2)] = (point.shape, dtype)
    for block in blocks.values():
        block.update({suffix: (legend, dtype) for suffix, (legend, dtype, _) in DERIVED.items()})
    return top, blocks[0], blocks[1]


def layer_site(name: str) -> tuple[int, str] | None:
    """(block index, suffix) of a block's site name, or None for a model-level (or no) site."""
    m = _LAYER_SITE.fullmatch(name)
    return (int(m.group(1)), m.group(2)) if m else None


def site_legend(args: ModelArgs, name: str) -> Site | None:
    """A site's (shape legend, dtype) in a model of this config, or None when it has no such site;
    from the name alone, so checking a file's sites costs nothing per block of the config."""
    top, dense, moe = _templates()
    where = layer_site(name)
    if where is None:
        return None if name.startswith("layers.") else top.get(name)
    i, suffix = where
    if i >= args.n_layers:
        return None
    return (dense if i < args.n_dense_layers else moe).get(suffix)


@lru_cache(maxsize=16)
def _site_shapes_cached(args: ModelArgs) -> dict[str, Site]:
    top, dense, moe = _templates()
    out = dict(top)
    for i in range(args.n_layers):
        for suffix, site in (dense if i < args.n_dense_layers else moe).items():
            out[f"layers.{i}.{suffix}"] = site
    return out


def site_shapes(args: ModelArgs) -> dict[str, Site]:
    """Every site name of a model of this config -> (shape legend, recorded dtype). One entry per
    site of every block: for a model that exists; a file's sites are checked with :func:`site_legend`."""
    return _site_shapes_cached(args)


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


def index_range(args: ModelArgs, name: str, n_tokens: int) -> tuple[int, int] | None:
    """The values an integer site may hold, ``low <= v < high``, or None for a float site: key
    positions (-1 where fewer keys are visible than are selected), experts, groups, token ids."""
    if name.endswith("attn.indexer.topk_indices"):
        return -1, n_tokens
    if name.endswith("ffn.gate.topk_indices"):
        return 0, args.n_routed_experts
    if name.endswith("ffn.gate.groups"):
        return 0, args.n_expert_groups
    if name.endswith("logit_lens.topk_indices"):
        return 0, args.vocab_size
    return None


def select(args: ModelArgs, patterns: str | tuple[str, ...] | list[str] | None) -> list[str]:
    """Site names matching glob patterns (``*`` crosses dots); 'default' and 'all' are shorthands.

    Raises InputError for a pattern of the user's that matches nothing, so typos do not silently
    record nothing; the default patterns need not match (a model without a MoE block has no gate).
    ``tokens``, the prompt's ids, is a site of every trace and always recorded: it is accepted and
    not listed.
    """
    names = list(site_shapes(args))
    if patterns is None:
        patterns = "default"
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
            if not matched and not fnmatch.fnmatchcase("tokens", pattern):
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
