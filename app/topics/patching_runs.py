"""The Patching page's runs as plain functions over an AppModel: a sweep of a clean and a corrupt prompt
(tracing.analyses.patching), the sweeps of an uploaded file of pairs with each cell's mean and interval
(tracing.analyses.prompt_sets), and one cell's patched run beside the corrupt run, for the two-run
comparison. The page lays these out; nothing here draws."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from app.core.models import AppModel
from app.core.traces import Entry, request_for, token_limit, token_of, trace_prompt
from tracing.analyses.patching import Cell, Sweep, patch_of, record_for, sweep
from tracing.analyses.prompt_sets import SetResult, parse_pairs, patching_over_pairs
from tracing.errors import InputError

MAX_RUNS = 3000  # one forward each (the exact method): a sweep larger than this is refused before it starts
MAX_PAIRS = 100  # a file's pairs, each a sweep: more wait on the command line (patching --pairs)


def run_sweep(
    om: AppModel,
    clean: str,
    corrupt: str,
    sites: Sequence[str],
    positions: str = "all",
    target: str = "",
    contrast: str = "",
    on_cell: Callable[[int, int], None] | None = None,
    method: str = "exact",
) -> Sweep:
    """Every cell of ``sites`` x blocks x ``positions`` of the clean prompt patched into the corrupt one, each
    scored by how much of the clean logit difference it restores; ``target`` and ``contrast`` (a token's text
    or id, empty: the clean and the corrupt top) name the difference; ``method`` "gradient" estimates every
    cell from one backward pass (attribution patching). InputError says why a sweep does not run."""
    if not sites:
        raise InputError("choose at least one site to patch")
    requests = [request_for(om, prompt) for prompt in (clean, corrupt)]
    return sweep(
        lambda request: om.trace(request, None, max_tokens=token_limit(om)),
        *requests,
        target=target.strip() or None,  # text or id, as token_of reads it
        contrast=contrast.strip() or None,
        sites=sites,
        positions=positions,
        max_runs=MAX_RUNS,
        token_id=lambda flag, value: token_of(om, flag, value),
        on_cell=on_cell,
        method=method,
    )


def run_pairs(
    om: AppModel,
    data: bytes,
    name: str,
    sites: Sequence[str],
    positions: str = "all",
    target: str = "",
    contrast: str = "",
    on_pair: Callable[[int, int], None] | None = None,
    method: str = "exact",
) -> SetResult:
    """Every pair of an uploaded file (JSONL or CSV with clean and corrupt, tracing.analyses.prompt_sets)
    swept as :func:`run_sweep` sweeps one, and per cell the mean over the pairs with its bootstrap interval.
    The file is read, every pair's length and tokens checked, before the first sweep."""
    if not sites:
        raise InputError("choose at least one site to patch")
    pairs = parse_pairs(data, name)
    if len(pairs) > MAX_PAIRS:
        raise InputError(f"{name}: {len(pairs)} pairs, more than the app sweeps ({MAX_PAIRS}): use patching --pairs")
    return patching_over_pairs(
        lambda request: om.trace(request, None, max_tokens=token_limit(om)),
        pairs,
        request=lambda text: request_for(om, text),
        n_tokens=lambda request: len(om.encode(request)),
        target=target.strip() or None,
        contrast=contrast.strip() or None,
        on_pair=on_pair,
        sites=sites,
        positions=positions,
        max_runs=MAX_RUNS,
        token_id=lambda flag, value: token_of(om, flag, value),
        method=method,
    )


def patched_cell(om: AppModel, clean: str, corrupt: str, cell: Cell, variant: str) -> tuple[Entry, Entry]:
    """The corrupt run and the corrupt run with ``cell``'s clean value put back at its position (named
    ``variant`` in the store), for the two-run comparison."""
    record = record_for(om.args, [cell.site])
    requests = [dataclasses.replace(request_for(om, p), record=record) for p in (clean, corrupt)]
    runs = [om.trace(r, None, token_limit(om)) for r in requests]
    site, value = patch_of(cell, *runs)
    base = trace_prompt(om, corrupt)
    patched = trace_prompt(om, corrupt, patches={site: value}, patch_positions=str(cell.position), variant=("patched", variant))
    return base, patched
