"""Where training reads a site's values and the next-token loss: a model loaded here, or a model server.

Both run one corpus batch at a time (tracing.atlas.corpus: sequences of one length) and answer two
questions: the rows a dictionary learns from (:meth:`rows`: the site's values, and for a transcoder
the FFN's output beside its input), and the next-token loss of each position with the site as the
model computes it and with the dictionary's reconstruction put in its place (:meth:`losses`). The
first position of a sequence that starts with BOS is left out of both rows and splice: its stream is
the attention sink's, orders of magnitude larger than any other, and a dictionary that spends
features on it reconstructs nothing else.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F

from model.hooks import Hooks

from ..analyses.interventions import HookFunctions, applied
from ..errors import InputError
from ..sites import hook_points
from .dictionary import Dictionary

SERVER_TRANSCODER = (
    "--server trains autoencoders on a recorded site; a transcoder reads the FFN's normed input, "
    "which a server does not record: train it with --checkpoint"
)


class _Enough(Exception):
    """Raised by the gathering hook once the site is read: the blocks after it need not run."""


class LocalModel:
    """A model loaded here (tracing.cli.loading.Loaded): hooks read the site as the batch runs."""

    def __init__(self, loaded, kind: str, site: str, layer: int, skip_first: bool):
        self.loaded, self.kind, self.site, self.layer = loaded, kind, site, layer
        self.skip = int(skip_first)
        model = loaded.model
        if kind == "sae":
            points = hook_points(model)
            if site not in points:
                raise InputError(f"{site}: not a hook point of this model ({model.args.n_layers} blocks)")
            self.module = points[site]
        else:
            if layer >= model.args.n_layers:
                raise InputError(f"{site}: this model has {model.args.n_layers} blocks")
            self.module = model.layers[layer].ffn

    def _read(self, hooks: Hooks, into: dict, stop: bool) -> None:
        def read(module, inputs, output):
            into["x"] = (output if self.kind == "sae" else inputs[0]).float()  # (B, T, D)
            into["y"] = None if self.kind == "sae" else output.float()
            if stop:
                raise _Enough

        hooks.after(self.module, read)

    def rows(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The site's rows of the batch, first positions skipped: (N, d_in) and (N, d_out) or None."""
        ids = torch.tensor(batch, dtype=torch.long, device=self.loaded.device)  # (B, T)
        got: dict = {}
        with Hooks() as hooks, torch.inference_mode(), self.loaded.context() or nullcontext():
            self._read(hooks, got, stop=True)
            try:
                self.loaded.model(ids)
            except _Enough:
                pass
        return _flat(got["x"], self.skip), None if got["y"] is None else _flat(got["y"], self.skip)

    def losses(self, batch: list[list[int]], d: Dictionary):
        """Clean rows (x, y or None, as :meth:`rows`) and the next-token NLL of positions 0..T-2,
        clean and with ``d``'s reconstruction in place of the site's value, each (B, T-1)."""
        ids = torch.tensor(batch, dtype=torch.long, device=self.loaded.device)  # (B, T)
        model, got = self.loaded.model, {}
        with torch.inference_mode(), self.loaded.context() or nullcontext():
            with Hooks() as hooks:
                self._read(hooks, got, stop=False)
                clean = model(ids, all_logits=True).float()  # (B, T, V)
            x, y = got["x"], got["y"]
            skip = self.skip

            def splice(value, ctx):
                new = d(x.to(d.W_enc.device)).to(value.device, value.dtype)  # (B, T, D)
                if skip:
                    new[:, :skip] = value[:, :skip]
                return new

            with applied(model, [HookFunctions({d.out_site: splice})]):
                spliced = model(ids, all_logits=True).float()
        return _flat(x, skip), None if y is None else _flat(y, skip), _nll(clean, ids), _nll(spliced, ids)


class ServerModel:
    """A model server (tracing.client.Client): one trace per sequence, recording the site, and the
    splice as a patch of the site's value. An autoencoder only: a server records sites, and a
    transcoder's input (the FFN's normed input) is not one."""

    def __init__(self, client, kind: str, site: str, skip_first: bool):
        if kind != "sae":
            raise InputError(SERVER_TRANSCODER)
        self.client, self.site, self.skip = client, site, int(skip_first)

    def _trace(self, seq: list[int], **fields):
        from ..runner import TraceRequest

        return self.client.trace(TraceRequest(token_ids=tuple(seq), **fields))

    def _site(self, trace) -> torch.Tensor:
        value = trace.tensors.get(self.site)
        if value is None:
            raise InputError(f"the server's trace holds no {self.site}: not a site of its model")
        return value.float()  # (T, D)

    def rows(self, batch: list[list[int]]) -> tuple[torch.Tensor, None]:
        values = [self._site(self._trace(seq, record=(self.site,))) for seq in batch]
        return _flat(torch.stack(values), self.skip), None  # (B, T, D) -> (N, D)

    def losses(self, batch: list[list[int]], d: Dictionary):
        xs, clean, spliced = [], [], []
        for seq in batch:
            trace = self._trace(seq, record=(self.site, "next.token_prob"))
            x = self._site(trace)  # (T, D)
            new = d(x)
            new[: self.skip] = x[: self.skip]
            patched = self._trace(seq, record=("next.token_prob",), patches={self.site: new})
            xs.append(x)
            clean.append(_from_probs(trace))
            spliced.append(_from_probs(patched))
        return _flat(torch.stack(xs), self.skip), None, torch.stack(clean), torch.stack(spliced)


def _from_probs(trace) -> torch.Tensor:
    """NLL of positions 0..T-2 from ``next.token_prob`` (T,) (the last position's is its greedy choice)."""
    p = trace.tensors["next.token_prob"].double()[:-1]
    return -p.clamp_min(1e-300).log()


def _nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(B, T, V) logits, (B, T) ids -> (B, T-1) the NLL of each next token."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").double()


def _flat(value: torch.Tensor, skip: int) -> torch.Tensor:
    """(B, T, D) -> (B * (T - skip), D) float32 on the CPU."""
    return value[:, skip:].reshape(-1, value.shape[-1]).float().cpu()
