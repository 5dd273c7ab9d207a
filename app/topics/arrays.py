"""A trace's values as numpy, for shaping."""

from __future__ import annotations

import numpy as np

from tracing.trace import Trace


def site(trace: Trace, block: int, suffix: str) -> np.ndarray | None:
    """Block ``block``'s ``suffix`` site (``ffn.gate.scores``), or None when the trace lacks it."""
    value = trace.site(block, suffix)
    return None if value is None else value.numpy()


def future_mask(n: int) -> np.ndarray:
    """[T, S] True where the key comes after the query."""
    return np.triu(np.ones((n, n), dtype=bool), 1)
