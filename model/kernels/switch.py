"""Whether the CPU routes are on: ``ANATOMY_KERNELS`` (``plain`` switches them off), read once per
process, or :func:`plain` in a context."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

ENV = "ANATOMY_KERNELS"
_FORCED: contextvars.ContextVar[bool | None] = contextvars.ContextVar("kernels", default=None)


@functools.lru_cache(maxsize=1)
def setting() -> str:
    """``ANATOMY_KERNELS`` as this process found it (read once; ``setting.cache_clear()`` reads it again)."""
    return os.environ.get(ENV, "").strip()


def enabled() -> bool:
    """Whether the CPU routes are on (``ANATOMY_KERNELS`` is not ``plain``, or :func:`plain` says otherwise)."""
    forced = _FORCED.get()
    return forced if forced is not None else setting().lower() != "plain"


def forced() -> bool:
    return _FORCED.get() is not None


@contextlib.contextmanager
def plain(on: bool = True):
    """The plain functions everywhere in this context (``on=False``: the CPU routes, whatever the setting)."""
    token = _FORCED.set(not on)
    try:
        yield
    finally:
        _FORCED.reset(token)
