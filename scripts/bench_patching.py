"""Attribution patching against the exact sweep it estimates: on clean/corrupt pairs, both methods of
``python -m tracing patching`` over the same cells, their correlation (over all cells and per
site), the cells where they disagree most, and the time of each.

    python scripts/bench_patching.py                         # the demo's pairs, every site and position
    python scripts/bench_patching.py --sites resid_pre,heads --positions last --top 5
    python scripts/bench_patching.py --checkpoint DIR --pair "clean text|corrupt text"

A benchmark run by hand, not a test; it prints one JSON object on stdout (progress on stderr). A
pair's two prompts must have one token length. The gradient method's time covers its clean run
and the corrupt run's forward and backward; both include the two short runs that find the target
and contrast.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tracing.startup import load_torch  # noqa: E402

load_torch()  # first: torch's idle OpenMP threads sleep (tracing.startup)

# isort: split
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from tracing.analyses.patching import METHODS, SITES, sweep  # noqa: E402
from tracing.cli.loading import DEMO, open_checkpoint  # noqa: E402
from tracing.runner import TraceRequest, run  # noqa: E402

# the demo's pairs (one token length each): a name the model completes, and a word that changes it
PAIRS = (
    ("Anne had not seen Captain", "Anne had not seen Colonel"),
    ("It is a truth universally acknowledged", "It is a truth universally denied"),
    ("Mr. Darcy looked at Elizabeth", "Mr. Darcy looked at Jane"),
)
KEYS = ["site", "block", "position", "index"]


def log(msg: str) -> None:
    print(f"[bench_patching {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def compare(exact: pd.DataFrame, gradient: pd.DataFrame, top: int) -> dict:
    """Correlation of the two methods' values over the cells (all, and per site) and the cells
    where they differ most."""
    both = exact.merge(gradient, on=KEYS, suffixes=("_exact", "_gradient"))
    if len(both) != len(exact):
        raise SystemExit("the two methods swept different cells")

    def pearson(frame: pd.DataFrame) -> float | None:
        x, y = frame["value_exact"].to_numpy(), frame["value_gradient"].to_numpy()
        if len(x) < 2 or x.std() == 0 or y.std() == 0:
            return None
        return round(float(np.corrcoef(x, y)[0, 1]), 4)

    both["gap"] = both["value_gradient"] - both["value_exact"]
    worst = both.reindex(both["gap"].abs().sort_values(ascending=False).index).head(top)
    return {
        "cells": len(both),
        "pearson": pearson(both),
        "by_site": {
            site: {
                "pearson": pearson(part),
                "max_abs_exact": round(float(part["value_exact"].abs().max()), 4),
                "max_abs_gradient": round(float(part["value_gradient"].abs().max()), 4),
            }
            for site, part in both.groupby("site", sort=False)
        },
        "mean_abs_gap": round(float(both["gap"].abs().mean()), 4),
        "disagree_most": [
            {k: (v if isinstance(v, str) else round(float(v), 4) if isinstance(v, float) else int(v)) for k, v in row.items()}
            for row in worst[[*KEYS, "value_exact", "value_gradient"]].to_dict("records")
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", default=DEMO, help="checkpoint directory (default: the bundled demo)")
    parser.add_argument("--pair", action="append", metavar="CLEAN|CORRUPT", help="a pair (repeatable; default: the demo's)")
    parser.add_argument("--sites", default=",".join(SITES))
    parser.add_argument("--positions", default="all")
    parser.add_argument("--top", type=int, default=5, help="cells of largest disagreement to list per pair")
    opts = parser.parse_args()
    pairs = [tuple(p.split("|", 1)) for p in opts.pair] if opts.pair else PAIRS
    loaded = open_checkpoint(opts.checkpoint)
    log(f"{loaded.label}: {len(pairs)} pairs, sites {opts.sites}, positions {opts.positions}")

    def traced(request: TraceRequest):
        return run(loaded.model, request, loaded.tokenizer)

    results = []
    for clean, corrupt in pairs:
        tables, seconds = {}, {}
        for method in METHODS:
            started = time.perf_counter()
            result = sweep(
                traced,
                TraceRequest(prompt=clean),
                TraceRequest(prompt=corrupt),
                sites=opts.sites,
                positions=opts.positions,
                method=method,
            )
            seconds[method] = round(time.perf_counter() - started, 2)
            tables[method] = result.table
            log(f"{clean!r} -> {corrupt!r}: {method} {len(result.table)} cells in {seconds[method]} s")
        s = result.summary
        results.append(
            {
                "clean": clean,
                "corrupt": corrupt,
                "tokens": s["tokens"],
                "logit_diff": {"clean": round(s["clean"]["logit_diff"], 4), "corrupt": round(s["corrupt"]["logit_diff"], 4)},
                "seconds": seconds,
                "speedup": round(seconds["exact"] / seconds["gradient"], 1),
                **compare(tables["exact"], tables["gradient"], opts.top),
            }
        )
    print(json.dumps({"checkpoint": loaded.label, "sites": opts.sites, "positions": opts.positions, "pairs": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
