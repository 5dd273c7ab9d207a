"""The causal check of a direct logit attribution: each of its largest parts (heads, routed experts)
removed at the attributed position only, and the target logit (minus the contrast's) measured again.

Like with like: the attribution splits one position's logit, so the part is removed there and
nowhere else (tracing.analyses.intervention_specs' ``@POSITION``); a head's probabilities are zeroed, an
expert's weighted output is zeroed with routing kept. The measured ``effect`` (the plain total less
the total without the part) holds the part's direct share plus what later blocks make of it; the
attributed value is the direct share alone, so the two agree where a part acts mostly directly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pandas as pd

from ..errors import InputError
from ..runner import TraceRequest
from ..trace import Trace

COLUMNS = ["part", "block", "kind", "index", "attributed", "effect", "removed"]
REMOVAL = {"head": "ablate_heads", "expert": "zero_experts"}  # the interventions' spec keys


def causal_check(
    run: Callable[[TraceRequest], Trace], request: TraceRequest, n: int = 10, trace: Trace | None = None
) -> pd.DataFrame:
    """For the ``n`` parts of ``request``'s attribution with the largest |value| (heads and routed
    experts), the attributed value beside the measured effect of removing the part at the attributed
    position; ``table.attrs["correlation"]`` is their Pearson correlation (NaN below 2 parts).

    ``run`` traces a request (``lambda r: tracing.run(model, r, tokenizer)``, a model server's
    client, the app's model); ``trace``: the request's own run when already made."""
    from ..tables.frames import attribution_table

    if not request.attribute:
        raise InputError("--causal applies to --attribute: the check removes the attribution's parts")
    if not isinstance(n, int) or n < 1:
        raise InputError(f"--causal {n}: give the number of parts to check, 1 or more")
    plain = trace if trace is not None else run(request)
    info = plain.extra["attribution"]
    position, total = info["position"], float(plain["attribution.total"][0])
    parts = attribution_table(plain)
    parts = parts[parts["kind"].isin(REMOVAL)]
    parts = parts.reindex(parts["value"].abs().sort_values(ascending=False, kind="stable").index).head(n)
    # the same target and contrast as resolved by the plain run, the same interventions besides
    fixed = dataclasses.replace(request, position=position, target=info["target"], contrast=info["contrast"])
    rows = []
    for part in parts.itertuples():
        key, where = REMOVAL[part.kind], f"{part.block}:{part.index}@{position}"
        spec = dict(fixed.interventions)
        if isinstance(spec.get(key), dict):
            raise InputError(f"--causal: the request's {key} is a block mapping; give it as LAYER:ID text")
        spec[key] = f"{spec[key]},{where}" if spec.get(key) else where
        without = run(dataclasses.replace(fixed, interventions=spec))
        effect = total - float(without["attribution.total"][0])
        removed = f"{'ablate heads' if part.kind == 'head' else 'zero'} {part.block}:{part.index} at position {position}"
        rows.append((part.part, part.block, part.kind, part.index, part.value, effect, removed))
    table = pd.DataFrame(rows, columns=COLUMNS)
    table.attrs["correlation"] = _correlation(table["attributed"].to_numpy(), table["effect"].to_numpy())
    table.attrs["total"] = total
    return table


def _correlation(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) < 2 or a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])
