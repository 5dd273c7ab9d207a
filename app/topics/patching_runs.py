"""The Patching page's runs as plain functions over an AppModel: a sweep of a clean and a corrupt prompt
(tracing.analyses.patching), and one cell's patched run beside the corrupt run, for the two-run
comparison. The page lays these out; nothing here draws."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from app.core.models import AppModel
from app.core.traces import Entry, request_for, token_limit, token_of, trace_prompt
from tracing.analyses.patching import Cell, Sweep, patch_of, record_for, sweep
from tracing.errors import InputError

MAX_RUNS = 3000  # one forward each (the exact method): a sweep larger than this is refused before it starts


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
