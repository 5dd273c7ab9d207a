"""Hook points: identity modules that give each internal value a stable dotted name.

The model calls ``self.some_point(tensor)`` where a value worth seeing exists; the trace name is the
module path (``layers.3.ffn.gate.topk_indices``). Forward hooks registered on a point may read the
value, or return a replacement (a patch), which the model then uses instead: code downstream of a
point always consumes the point's output.
"""

from __future__ import annotations

import threading

import torch
from torch import nn


class HookPoint(nn.Module):
    """Identity; ``shape`` documents the layout, e.g. ``"B T D"`` (B is dropped in traces)."""

    def __init__(self, shape: str):
        super().__init__()
        self.shape = shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @property
    def observed(self) -> bool:
        """True while a hook that fires in the calling thread is registered: values that exist only
        for the trace are computed. One model serves several threads, so another thread's
        :class:`Hooks` leave this thread's forward as it is (a hook registered without
        :class:`Hooks` observes every thread's)."""
        here = threading.get_ident()
        return any(getattr(hook, "thread", here) == here for hook in self._forward_hooks.values())

    def extra_repr(self) -> str:
        return self.shape


class Hooks:
    """Forward hooks on a model's modules, registered together and removed together (also after an
    exception: use it as a context manager), each firing only in the thread that made this set.
    One model serves several threads (the app's sessions): each thread's hooks see its own forward
    only. Everything that hooks a model (the tracer, its analyses, the atlas's counts, the
    streamer) registers through one of these."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self._handles: list = []

    def mine(self) -> bool:
        """Whether the calling thread made these hooks."""
        return threading.get_ident() == self.thread

    def after(self, module: nn.Module, fn, *, prepend: bool = False) -> None:
        """``fn(module, inputs, output)`` after ``module`` runs; what it returns (not None) replaces the output."""

        def hook(m, inputs, output):
            return fn(m, inputs, output) if self.mine() else None

        hook.thread = self.thread  # whose forward it observes (HookPoint.observed)
        self._handles.append(module.register_forward_hook(hook, prepend=prepend))

    def before(self, module: nn.Module, fn, *, prepend: bool = False, with_kwargs: bool = False) -> None:
        """``fn(module, args)`` (with ``with_kwargs``: ``fn(module, args, kwargs)``) before ``module`` runs."""

        def hook(m, *args):
            return fn(m, *args) if self.mine() else None

        self._handles.append(module.register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Hooks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()
