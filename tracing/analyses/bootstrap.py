"""The bootstrap interval of a mean over a set of prompts: the one place it is computed (patching
over pairs, the causal check and ``eval`` over prompts, tracing.analyses.prompt_sets).

The unit resampled is the prompt (or the pair), never the position: the positions of one prompt
share its words and move together, so resampling them would pretend to more evidence than the set
holds. Each of ``resamples`` draws takes n prompts with replacement from the n, forms the
(weighted) mean again, and the interval is the draws' 2.5 and 97.5 percentiles (the percentile
bootstrap, Efron and Tibshirani 1993, ch. 13). It says how much the mean would move with another
set of prompts like these; it says nothing about prompts unlike them. With few prompts it is too
narrow (n prompts give the draws only n values to mix): read it with its ``n``.

A draw is a vector of counts (how often each prompt was taken, a multinomial), so every statistic
of every draw is one matrix product: counts (draws x prompts) @ values (prompts x statistics).
Seeded: the same seed, values and ``resamples`` give the same interval, bit for bit on one machine.
"""

from __future__ import annotations

import warnings

import numpy as np
import pandas as pd

from ..errors import InputError
from ..sampling import SEEDS

RESAMPLES = 10_000  # draws: the percentiles then move by about 0.03 standard errors from seed to seed
MAX_RESAMPLES = 100_000
SEED = 0  # a fixed default: two runs of one command give one interval
LEVEL = 0.95
COLUMNS = ["n", "mean", "ci_low", "ci_high"]
_CELLS = 1 << 22  # draws x statistics formed at once (32 MiB of float64)
MAX_COUNTS = 1 << 24  # draws x prompts held at once (128 MiB of float64): 10,000 draws of 1,677 prompts


def check(resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL, prompts: int = 1) -> None:
    """Refuse settings the bootstrap cannot use, before any model runs (``prompts``: the set's size)."""
    if isinstance(resamples, bool) or not isinstance(resamples, int) or not 1 <= resamples <= MAX_RESAMPLES:
        raise InputError(f"--resamples {resamples}: give 1 to {MAX_RESAMPLES:,} draws")
    if resamples * prompts > MAX_COUNTS:
        raise InputError(
            f"--resamples {resamples:,} draws of {prompts:,} prompts exceed what the bootstrap holds "
            f"({MAX_COUNTS:,} counts): give --resamples {MAX_COUNTS // prompts:,} or fewer"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not SEEDS[0] <= seed <= SEEDS[1]:
        raise InputError(f"--bootstrap-seed {seed}: must be between {SEEDS[0]} and {SEEDS[1]}")
    if not 0 < level < 1:
        raise InputError(f"the interval's level {level}: must be between 0 and 1")


def bootstrap(
    values: np.ndarray,
    weights: np.ndarray | None = None,
    resamples: int = RESAMPLES,
    seed: int = SEED,
    level: float = LEVEL,
) -> pd.DataFrame:
    """Per statistic (a column of ``values``, prompts x statistics; a vector is one statistic): the
    number of prompts that have it, the weighted mean over them and its bootstrap interval.

    NaN marks a prompt without the statistic (a cell its sweep did not reach): it takes no part in
    that mean. ``weights`` (prompts, or prompts x statistics; default 1) weigh each prompt's value,
    e.g. its number of positions, so the mean is per position while the prompt stays the unit
    drawn. A draw that takes none of a statistic's prompts is left out of its percentiles."""
    x = np.asarray(values, dtype=np.float64)
    x = x[:, None] if x.ndim == 1 else x  # (n, k)
    n, k = x.shape
    check(resamples, seed, level, n)
    w = np.ones_like(x) if weights is None else np.broadcast_to(np.asarray(weights, dtype=np.float64).reshape(n, -1), x.shape)
    if not np.isfinite(w).all() or (w < 0).any():
        raise InputError("bootstrap: weights must be finite and not negative")
    present = np.isfinite(x) & (w > 0)
    w = np.where(present, w, 0.0)
    xw = np.where(present, x, 0.0) * w  # (n, k)
    out = np.full((k, 4), np.nan)
    out[:, 0] = present.sum(axis=0)
    if n == 0:
        return pd.DataFrame(out, columns=COLUMNS).astype({"n": int})
    with np.errstate(invalid="ignore", divide="ignore"):
        out[:, 1] = xw.sum(axis=0) / w.sum(axis=0)
    rng = np.random.default_rng(seed)
    counts = rng.multinomial(n, np.full(n, 1.0 / n), size=resamples).astype(np.float64)  # (B, n): one draw a row
    tail = (1 - level) / 2
    step = max(1, _CELLS // resamples)
    for start in range(0, k, step):
        cols = slice(start, start + step)
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (counts @ xw[:, cols]) / (counts @ w[:, cols])  # (B, step): each draw's mean
        with warnings.catch_warnings():  # a statistic no draw reaches (n = 0) is NaN, said by its n
            warnings.simplefilter("ignore", RuntimeWarning)
            out[cols, 2:] = np.nanquantile(means, [tail, 1 - tail], axis=0).T
    return pd.DataFrame(out, columns=COLUMNS).astype({"n": int})
