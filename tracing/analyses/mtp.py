"""The MTP module's drafts against what the model wrote: speculative decoding's acceptance.

``mtp.topk_indices[t]`` drafts token t+2 from token t+1 and the main model's state at t
(model/mtp.py). Position p's draft is therefore row p - 2's best token, made one step before the
main model chose token p; it is accepted when it equals that token. In a generation the drafts
that a speculative decoder would verify are those of the tokens after the first generated one
(their row read a generated token); the first generated token's draft read the prompt only.
"""

from __future__ import annotations

import numpy as np
import torch

NOTE_NONE = "the checkpoint has no multi-token-prediction module: no drafts (mtp.* sites)"
NOTE_SKIPPED = "the checkpoint's multi-token-prediction module is not loaded (--no-mtp): no drafts"


def note(model) -> str | None:
    """What a trace says about the MTP module when the model drafts nothing, or None when it can."""
    if model.args.n_mtp_layers:
        return None
    return NOTE_SKIPPED if getattr(model, "mtp_skipped", False) else NOTE_NONE


def drafted(top: torch.Tensor | np.ndarray, probs: torch.Tensor | np.ndarray | None = None):
    """Per position p: the draft made for token p (row p - 2's best; -1 before position 2) and its
    probability (NaN there)."""
    top = np.asarray(top)
    ids = np.full(len(top), -1, dtype=np.int64)
    ids[2:] = top[:-2, 0]
    p = np.full(len(top), np.nan)
    if probs is not None:
        p[2:] = np.asarray(probs)[:-2, 0]
    return ids, p


def verified(n_tokens: int, start: int | None) -> np.ndarray:
    """Per position: whether its draft is one a speculative decoder verifies, the one definition of
    the acceptance: the generated tokens after the first (positions start + 1 ..), whose row read a
    generated token. The first generated token's draft read the prompt only, and no decoder checks a
    prompt token's; ``start`` None: no generation, no verified draft."""
    marked = np.zeros(n_tokens, dtype=bool)
    if start is not None:
        marked[max(start + 1, 2) :] = True
    return marked


def acceptance(tokens: list[int], top: torch.Tensor | np.ndarray, start: int) -> dict:
    """The verified drafts (:func:`verified`; the steps table's ``mtp_verified`` rows): how many, how
    many equal the token the model chose, and their share (None when there were none)."""
    ids, _ = drafted(top)
    positions = np.flatnonzero(verified(len(tokens), start))
    accepted = sum(int(ids[p] == tokens[p]) for p in positions)
    n = len(positions)
    return {"drafts": n, "accepted": accepted, "rate": round(accepted / n, 6) if n else None}
