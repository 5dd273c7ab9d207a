"""Copies of weights made once and kept while the weight is: FP8 weights dequantised for the CPU's
products (FP8 to float conversion is slow there), bfloat16 ones laid out for oneDNN, a MoE block's
experts prepared together, a CUDA weight's bfloat16 copy (within kernels.cuda's budget); and facts
about a tensor worked out once (:func:`decided`: whether its scales are powers of two).

A copy is kept beside its weight (weakly: it goes when the weight goes) and made again when the
weight's storage or version changes. Nothing is kept for a weight that is trained (it requires
grad), on a device other than the CPU or a CUDA GPU, or used once (:func:`use_once`: the streamer's
weights, freed after their block), so the copies never hold memory that the caller expects to be
freed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

import torch
from torch.utils.weak import WeakIdKeyDictionary

T = TypeVar("T")
_KEPT: WeakIdKeyDictionary = WeakIdKeyDictionary()  # weight -> {key: (stamp, copy)}
_LOCK = threading.Lock()
_ONCE = "_anatomy_used_once"
_DEVICES = ("cpu", "cuda")


def use_once(weight: torch.Tensor) -> torch.Tensor:
    """Mark ``weight`` as read by one forward only (a streamed block's): no copy of it is kept."""
    setattr(weight, _ONCE, True)
    return weight


def keeps(weight: torch.Tensor) -> bool:
    """Whether copies of ``weight`` may be kept."""
    return weight.device.type in _DEVICES and not weight.requires_grad and not getattr(weight, _ONCE, False)


def _stamp(t: torch.Tensor | None) -> tuple:
    if t is None:
        return (None,)
    try:
        version = t._version
    except RuntimeError:  # an inference tensor keeps no version counter (it cannot be changed outside inference mode)
        version = None
    return (t.data_ptr(), version)


MISSING = object()


def get(weight: torch.Tensor, key: Hashable, depends: Sequence[torch.Tensor | None] = ()):
    """The copy kept with ``weight`` under ``key``, if it and ``depends`` hold what they held when
    it was made; else MISSING."""
    if not keeps(weight):
        return MISSING
    with _LOCK:
        known = _KEPT.get(weight)
        hit = known.get(key) if known is not None else None
    if hit is None or hit[0] != (_stamp(weight), *map(_stamp, depends)):
        return MISSING
    return hit[1]


def put(weight: torch.Tensor, key: Hashable, value, depends: Sequence[torch.Tensor | None] = ()) -> None:
    """Keep ``value`` with ``weight`` under ``key`` (where copies of the weight are kept)."""
    if not keeps(weight):
        return
    stamp = (_stamp(weight), *map(_stamp, depends))
    with _LOCK:
        known = _KEPT.get(weight)
        if known is None:
            known = _KEPT[weight] = {}
        known[key] = (stamp, value)


def kept(weight: torch.Tensor, key: Hashable, make: Callable[[], T], depends: Sequence[torch.Tensor | None] = ()) -> T:
    """``make()``, kept with ``weight`` under ``key`` while it and ``depends`` (its scale) hold the
    same storage and version."""
    value = get(weight, key, depends)
    if value is MISSING:
        value = make()
        put(weight, key, value, depends)
    return value


def decided(t: torch.Tensor, key: Hashable, decide: Callable[[], T]) -> T:
    """``decide()``, worked out once while ``t`` holds the same storage and version, and kept with
    it (weakly) whatever its device and use: a fact about a tensor (a bool) holds no memory worth
    freeing, and a streamed weight's scales are read by every product of the weight."""
    value = known(t, key)
    if value is not MISSING:
        return value
    value = decide()
    remember(t, key, value)
    return value


def known(t: torch.Tensor, key: Hashable):
    """What :func:`decided` keeps for ``t`` under ``key``, if ``t`` holds what it held then; else MISSING."""
    with _LOCK:
        facts = _KEPT.get(t)
        hit = facts.get(key) if facts is not None else None
    return hit[1] if hit is not None and hit[0] == (_stamp(t),) else MISSING


def remember(t: torch.Tensor, key: Hashable, value) -> None:
    """Keep ``value`` as what :func:`decided` gives for ``t`` under ``key`` (decided elsewhere: a
    batch of tensors at once, or from the host copy a device tensor was made from)."""
    with _LOCK:
        facts = _KEPT.get(t)
        if facts is None:
            facts = _KEPT[t] = {}
        facts[key] = ((_stamp(t),), value)
