"""Activation patching between two prompts of one length: the corrupt run, with one value of the
clean run put back at one block and position (and one head or expert), scored by the logit
difference target - contrast after the last position.

``value`` = (patched - corrupt) / (clean - corrupt): 1 restores the clean answer, 0 changes nothing.
The sites, as TransformerLens' patching sweeps have them:

* ``resid_pre``, ``attn_out``, ``ffn_out``: the block's stream entering it, its attention update,
  its FFN update, at one position;
* ``heads``: one head's output before ``wo`` (``attn.head_out``), the other heads as the corrupt run
  has them;
* ``experts``: one routed expert's weighted output in the routed sum (``ffn.routed_out`` less the
  corrupt run's part of that expert, plus the clean run's), for the experts either run chose there.

Every patch is a value at positions (``TraceRequest.patches`` with ``patch_positions``), so a sweep
runs wherever a request runs: in this process, or on a model server. Cost: one forward per cell
(the count is known before the first, :func:`plan`); a patch at position p leaves the positions
before it as the corrupt run has them, bit for bit, but the forward still computes them (the
reference's prefill has no resumable prefix to start from).

``method="gradient"`` is attribution patching (Nanda 2023; AtP, Kramar et al. 2024): every cell
from one backward pass of the corrupt run (``TraceRequest.gradient_of``), the patched logit
difference estimated to first order as the corrupt one plus grad . (clean - corrupt) at the cell's
site, position and head or expert. The gradient holds the indexer's and the router's selections
fixed and passes the FP8 roundings straight through (model.fp8.straight_through); the exact method
is its check (scripts/bench_patching.py, docs/attribution.md).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch

from ..errors import InputError
from ..runner import TraceRequest
from ..sites import site_name
from ..trace import Trace

SITES = ("resid_pre", "attn_out", "ffn_out", "heads", "experts")
METHODS = ("exact", "gradient")  # one patched forward per cell, or every cell from one backward
COLUMNS = ["site", "block", "position", "index", "logit_diff", "value", "method"]
RECORD = {  # what the clean and corrupt runs record for each kind of patch
    "resid_pre": ("resid_pre",),
    "attn_out": ("attn_out",),
    "ffn_out": ("ffn_out",),
    "heads": ("attn.head_out",),
    "experts": ("ffn.expert_out", "ffn.routed_out", "ffn.gate.topk_indices"),
}


@dataclass(frozen=True)
class Cell:
    """One patched run: the site kind, block, position and head or expert (-1 for none)."""

    site: str
    block: int
    position: int
    index: int = -1


def parse_sites(text: str | Iterable[str]) -> tuple[str, ...]:
    names = tuple(s.strip() for s in (text.split(",") if isinstance(text, str) else text) if s.strip())
    unknown = [s for s in names if s not in SITES]
    if unknown or not names:
        raise InputError(f"--sites {unknown[0] if unknown else ''!r}: choose from {', '.join(SITES)}")
    return names


def parse_method(text: str) -> str:
    if text not in METHODS:
        raise InputError(f"--method {text!r}: choose from {', '.join(METHODS)}")
    return text


def parse_positions(text: str, n_tokens: int) -> list[int]:
    """``all``, ``last`` or ``A:B`` (positions A..B-1) of a prompt of ``n_tokens``."""
    from .intervention_specs import parse_positions as positions_range

    if text == "all":
        return list(range(n_tokens))
    if text == "last":
        return [n_tokens - 1]
    first, stop = positions_range("--positions", text)
    chosen = list(range(first, min(n_tokens, n_tokens if stop is None else stop)))
    if not chosen:
        raise InputError(f"--positions {text}: no position of the {n_tokens} tokens")
    return chosen


def _blocks(cfg, site: str) -> range:
    return range(cfg.n_dense_layers, cfg.n_layers) if site == "experts" else range(cfg.n_layers)


def record_for(cfg, sites: Iterable[str]) -> tuple[str, ...]:
    """What the clean and the corrupt run record: every value a cell patches from."""
    names = {site_name(b, suffix) for site in sites for b in _blocks(cfg, site) for suffix in RECORD[site]}
    return (*sorted(names), "logits.last", "next.topk_indices")


def plan(clean: Trace, corrupt: Trace, sites: Iterable[str], positions: list[int]) -> list[Cell]:
    """Every cell of the sweep, before any runs: its size is its cost."""
    cfg = clean.config
    cells = []
    for site in sites:
        for block in _blocks(cfg, site):
            for p in positions:
                if site == "heads":
                    cells.extend(Cell(site, block, p, h) for h in range(cfg.n_heads))
                elif site == "experts":
                    chosen = {int(e) for t in (clean, corrupt) for e in t.site(block, "ffn.gate.topk_indices")[p]}
                    cells.extend(Cell(site, block, p, e) for e in sorted(chosen))
                else:
                    cells.append(Cell(site, block, p))
    return cells


def patch_of(cell: Cell, clean: Trace, corrupt: Trace) -> tuple[str, torch.Tensor]:
    """The site and the whole value whose row at the cell's position the patched run takes."""
    b, p = cell.block, cell.position
    if cell.site in ("resid_pre", "attn_out", "ffn_out"):
        return site_name(b, cell.site), clean.site(b, cell.site)
    if cell.site == "heads":
        value = corrupt.site(b, "attn.head_out").clone()  # (T, H, Dv): the other heads as the corrupt run has them
        value[p, cell.index] = clean.site(b, "attn.head_out")[p, cell.index]
        return site_name(b, "attn.head_out"), value
    value = corrupt.site(b, "ffn.routed_out").clone()  # (N, D)
    value[p] += _expert_part(clean, b, p, cell.index) - _expert_part(corrupt, b, p, cell.index)
    return site_name(b, "ffn.routed_out"), value


GRADIENT_OF = {"resid_pre": "resid_pre", "attn_out": "attn_out", "ffn_out": "ffn_out", "heads": "attn.head_out"}
GRADIENT_OF["experts"] = "ffn.routed_out"  # the routed sum: an expert's weighted output adds to it as it is


def gradient_sites(cfg, sites: Iterable[str]) -> tuple[str, ...]:
    """The grad.* sites the gradient method reads for these kinds of cell."""
    return tuple(sorted({site_name(b, "grad." + GRADIENT_OF[site]) for site in sites for b in _blocks(cfg, site)}))


def estimate(cell: Cell, clean: Trace, corrupt: Trace) -> float:
    """The first-order change of the logit difference when the cell's value goes from the corrupt
    run's to the clean run's: grad . (clean - corrupt), the gradient the corrupt run's backward
    recorded at the cell's site (``corrupt`` holds the grad.* sites)."""
    b, p = cell.block, cell.position
    suffix = GRADIENT_OF[cell.site]
    grad = corrupt.site(b, "grad." + suffix)[p]  # (D) or (H, Dv)
    if cell.site == "experts":
        delta = _expert_part(clean, b, p, cell.index) - _expert_part(corrupt, b, p, cell.index)
    else:
        delta = clean.site(b, suffix)[p] - corrupt.site(b, suffix)[p]
    if cell.site == "heads":
        grad, delta = grad[cell.index], delta[cell.index]
    return float((grad.double() * delta.double()).sum())


def _expert_part(trace: Trace, block: int, position: int, expert: int) -> torch.Tensor:
    """The expert's weighted output in the position's routed sum (zeros when it was not chosen)."""
    slots = trace.site(block, "ffn.gate.topk_indices")[position].sort().values  # expert_out's slots, ascending
    out = trace.site(block, "ffn.expert_out")[position]  # (k, D)
    hit = (slots == expert).nonzero()
    return out[int(hit[0, 0])] if len(hit) else torch.zeros_like(out[0])


@dataclass
class Sweep:
    """The table (one row per cell) and both runs' figures."""

    table: pd.DataFrame
    summary: dict


def sweep(
    run: Callable[[TraceRequest], Trace],
    clean: TraceRequest,
    corrupt: TraceRequest,
    target: int | str | None = None,
    contrast: int | str | None = None,
    sites: Iterable[str] = SITES,
    positions: str = "all",
    max_runs: int = 5000,
    token_id: Callable[[str, int | str], int] | None = None,
    on_cell: Callable[[int, int], None] | None = None,
    method: str = "exact",
) -> Sweep:
    """Patch every cell of ``sites`` x blocks x ``positions`` of ``clean`` into ``corrupt`` (two
    requests of prompts or token ids of one length) and score each. ``run`` traces a request
    (``lambda r: tracing.run(model, r, tokenizer)``, a server's client); ``target`` and ``contrast``
    default to the clean and the corrupt run's top next token (``token_id`` resolves a token's
    text); more cells than ``max_runs`` are refused before the first run. ``on_cell(i, n)``: progress
    of the exact method's runs. ``method``: "exact" (one patched run per cell) or "gradient" (every
    cell from the corrupt run's backward pass, :func:`estimate`; ``max_runs`` does not bound it)."""
    sites = parse_sites(sites)
    method = parse_method(method)
    probe = [run(dataclasses.replace(r, record=("next.topk_indices",))) for r in (clean, corrupt)]
    lengths = [t.n_tokens for t in probe]
    if lengths[0] != lengths[1]:
        raise InputError(f"the clean prompt has {lengths[0]} tokens and the corrupt one {lengths[1]}: patching needs one length")
    cfg, n = probe[0].config, lengths[0]
    chosen = parse_positions(positions, n)
    if "experts" in sites and not cfg.n_moe_layers:
        raise InputError("--sites experts: this model has no MoE blocks")
    record = record_for(cfg, sites)
    resolve = token_id or (lambda flag, value: int(value))
    target_id = int(probe[0]["next.topk_indices"][-1, 0]) if target is None else resolve("--target", target)
    contrast_id = _contrast(probe[1], target_id) if contrast is None else resolve("--contrast", contrast)
    if target_id == contrast_id:
        raise InputError(f"--target and --contrast are both token {target_id}: the logit difference would be 0")
    started = time.perf_counter()
    a = run(dataclasses.replace(clean, record=record))
    if method == "gradient":  # the corrupt run's forward, and one backward from its logit difference
        wanted = (*record, *gradient_sites(cfg, sites))
        b = run(dataclasses.replace(corrupt, record=wanted, gradient_of=(target_id, contrast_id)))
    else:
        b = run(dataclasses.replace(corrupt, record=record))

    def score(t: Trace) -> float:
        return float(t["logits.last"][target_id] - t["logits.last"][contrast_id])

    high, low = score(a), score(b)
    cells = plan(a, b, sites, chosen)
    if method == "gradient":
        rows = []
        for cell in cells:
            moved = low + estimate(cell, a, b)
            share = (moved - low) / (high - low) if high != low else float("nan")
            rows.append((cell.site, cell.block, cell.position, cell.index, moved, share, method))
    elif len(cells) > max_runs:
        raise InputError(f"{len(cells)} patched runs (one per cell) exceed --max-runs {max_runs}: fewer sites or positions")
    else:
        rows = _exact(run, corrupt, a, b, cells, score, low, high, on_cell)
    summary = {
        "method": method,
        "tokens": n,
        "target": target_id,
        "contrast": contrast_id,
        "clean": {"prompt": clean.prompt, "tokens": a.tokens, "logit_diff": high, "top": int(a["next.topk_indices"][-1, 0])},
        "corrupt": {"prompt": corrupt.prompt, "tokens": b.tokens, "logit_diff": low, "top": int(b["next.topk_indices"][-1, 0])},
        "differing_positions": [p for p in range(n) if a.token_ids[p] != b.token_ids[p]],
        "sites": list(sites),
        "positions": chosen,
        "cells": len(cells),
        "runs": len(cells) if method == "exact" else 2,  # patched runs, or the clean run and the corrupt one's backward
        "seconds": round(time.perf_counter() - started, 3),
    }
    return Sweep(pd.DataFrame(rows, columns=COLUMNS), summary)


def _exact(run, corrupt: TraceRequest, a: Trace, b: Trace, cells: list[Cell], score, low: float, high: float, on_cell) -> list:
    """One patched run of the corrupt request per cell: its rows."""
    rows = []
    for i, cell in enumerate(cells):
        if on_cell is not None:
            on_cell(i, len(cells))
        name, value = patch_of(cell, a, b)
        patched = run(
            dataclasses.replace(corrupt, record=("logits.last",), patches={name: value}, patch_positions=str(cell.position))
        )
        moved = score(patched)
        share = (moved - low) / (high - low) if high != low else float("nan")
        rows.append((cell.site, cell.block, cell.position, cell.index, moved, share, "exact"))
    return rows


def _contrast(corrupt: Trace, target: int) -> int:
    """The corrupt run's top next token, or its second when that is the target."""
    top = corrupt["next.topk_indices"][-1].tolist()
    return top[0] if top[0] != target else top[1]
