"""Selections as grids: the sites that name what was chosen (experts, groups, keys) hold indices,
and tables and plots want one cell per candidate."""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike


def index_grid(indices: ArrayLike, n: int, values: ArrayLike = True, fill: Any = False, dtype: DTypeLike = bool) -> np.ndarray:
    """(R, k) indices into n candidates -> an (R, n) grid: ``values`` (broadcast to (R, k): one per
    choice, e.g. its rank or weight) where row r chose a candidate, ``fill`` elsewhere. -1 means no
    choice (a query with fewer visible keys than the indexer keeps) and marks nothing."""
    indices = np.asarray(indices)
    rows = indices.shape[0]
    out = np.full((rows, n + 1), fill, dtype=dtype)  # the extra column absorbs the -1s
    out[np.arange(rows)[:, None], np.where(indices < 0, n, indices)] = values
    return np.ascontiguousarray(out[:, :n])
