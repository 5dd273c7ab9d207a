"""The Tracer: forward hooks on hook points that copy chosen values to the CPU, or patch them.

Hooks belong to the thread that entered the tracer: a model shared by several threads (the app
serves every browser session from its own thread) records each thread's run into its own tracer,
and patches apply only to the run that asked for them. Hooks are removed on exit, also after an
exception.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

import torch

from model.config import ModelArgs

from .errors import InputError
from .sites import DERIVED, hook_points, select

_DERIVED_FROM = {
    "attn.indexer.recall": "attn.scores",
    "attn.probs_mean": "attn.probs",
}


class Tracer:
    """Record sites of ``model`` while a forward pass runs in this thread.

    ``record``: site names or glob patterns (see :func:`tracing.sites.select`). ``patches``: site
    name -> value (the trace's shape, batch dimension dropped) that replaces the site's value.
    ``on_block``: called with the block index before each block runs (progress).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        record: Iterable[str] | str | None = None,
        patches: Mapping[str, torch.Tensor] | None = None,
        on_block: Callable[[int], None] | None = None,
    ):
        self.model = model
        self.args: ModelArgs = model.args
        self.sites = select(self.args, record)
        self.patches = dict(patches or {})
        self.on_block = on_block
        self.values: dict[str, torch.Tensor] = {}
        self._handles: list = []
        self._thread: int | None = None
        self._topk: dict[int, torch.Tensor] = {}

    # context manager ---------------------------------------------------------------------
    def __enter__(self) -> Tracer:
        if self._thread is not None:
            raise RuntimeError("a Tracer can be entered once at a time")
        self._thread = threading.get_ident()
        self.values.clear()
        try:
            self._register()
        except BaseException:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._remove()

    def _remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._thread = None

    # hooks ---------------------------------------------------------------------------------
    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _register(self) -> None:
        points = hook_points(self.model)
        for name in self.patches:
            if name not in points:
                raise InputError(f"patch {name!r} is not a trace site this model can patch")
        wanted = set(self.sites)
        derived: dict[str, list[str]] = {}  # hook point -> derived sites computed from its value
        for name in self.sites:
            layer, _, suffix = name.partition(".")[2].partition(".")
            if suffix in _DERIVED_FROM:
                derived.setdefault(f"layers.{layer}.{_DERIVED_FROM[suffix]}", []).append(name)
        for name, point in points.items():
            patch = self.patches.get(name)
            if name in wanted or patch is not None or name in derived:
                self._handles.append(point.register_forward_hook(self._hook(name, name in wanted, patch, derived.get(name, []))))
        # recall needs the selection the attention used: registered last, these see patched values
        for name in self.sites:
            if name.endswith("attn.indexer.recall"):
                layer = int(name.split(".")[1])
                point = points[f"layers.{layer}.attn.indexer.topk_indices"]
                self._handles.append(point.register_forward_hook(self._keep_topk(layer)))
        if self.on_block is not None:
            for i, block in enumerate(self.model.layers):
                self._handles.append(block.register_forward_pre_hook(self._progress(i)))

    def _hook(self, name: str, record: bool, patch: torch.Tensor | None, derived: list[str]):
        def hook(module, inputs, output):
            if not self._mine():
                return None
            if patch is not None:
                output = _as_batched(patch, output, name)
            if record:
                self.values[name] = _to_cpu(output, module.shape)
            for target in derived:
                self.values[target] = self._derive(target, output)
            return output if patch is not None else None

        return hook

    def _keep_topk(self, layer: int):
        def hook(module, inputs, output):
            if self._mine():
                self._topk[layer] = output.detach()

        return hook

    def _progress(self, index: int):
        def hook(module, inputs):
            if self._mine():
                self.on_block(index)

        return hook

    def _derive(self, target: str, value: torch.Tensor) -> torch.Tensor:
        layer = int(target.split(".")[1])
        if target.endswith("attn.probs_mean"):
            return value[0].float().mean(dim=1).cpu()  # (T, H, S) -> (T, S)
        # recall: dense softmax over the causal keys, mass on the indexer's selection, mean over heads
        scores = value[0].float()  # (T, H, S)
        t, _, s = scores.shape
        start = s - t
        causal = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril(start)
        dense = scores.masked_fill(~causal[:, None, :], float("-inf")).softmax(dim=-1)
        topk = self._topk[layer][0]  # (T, K)
        slot = torch.where(topk < 0, s, topk)
        keep = torch.zeros(t, s + 1, dtype=torch.bool, device=scores.device).scatter_(-1, slot, True)[:, :s] & causal
        return (dense * keep[:, None, :]).sum(-1).mean(-1).cpu()


def _to_cpu(value: torch.Tensor, legend: str) -> torch.Tensor:
    out = value.detach()
    if legend.startswith("B"):
        if out.shape[0] != 1:
            raise InputError("tracing records batch size 1")
        out = out[0]
    if out.is_floating_point():
        out = out.float()
    return out.to("cpu", copy=True)


def _as_batched(patch: torch.Tensor, output: torch.Tensor, name: str) -> torch.Tensor:
    value = patch.to(device=output.device)
    if value.dim() == output.dim() - 1:
        value = value.unsqueeze(0)
    if value.shape != output.shape:
        got = tuple(patch.shape)
        want = tuple(output.shape[1:]) if value.dim() == output.dim() else tuple(output.shape)
        raise InputError(f"patch {name!r} has shape {list(got)}, this run needs {list(want)}")
    return value.to(output.dtype)


__all__ = ["DERIVED", "Tracer"]
