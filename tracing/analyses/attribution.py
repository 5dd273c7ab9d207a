"""Direct logit attribution: which parts of the final stream made one logit.

The final stream (the float32 sum the final RMSNorm reads) is the embedding plus every block's
attention and FFN updates. With the norm's scale frozen at its actual value (the float32 gain times
1/rms of the actual final stream) the head is linear in the stream, so the target logit splits
into one number per part:

    part_value = W_head[target] . (gamma * part / rms)      (minus the same with W_head[contrast])

Parts: the embedding; each attention head (``wo`` is linear in its FP8-rounded input, and each head
owns a slice of its columns: the head's part is that slice of the rounded, dequantised input
through the same columns of the dequantised weight, in float32); each routed expert chosen at the
position (its gate weight times its output, ``ffn.expert_out``) and the shared expert; a dense
block's MLP as one. What the bfloat16 carry of the stream, the bfloat16 rounding of each update and
of the normalised state leave is ``attribution.rest`` = total - sum of parts, reported, not hidden.

Each head's part splits further over the key positions s it read: its output is
``sum_s p[t, h, s] v[s, h]`` (tracing.analyses.heads), so key s's share is ``p[t, h, s] v[s, h]`` through the
head's columns of ``wo``, along the same direction; a key the indexer did not select has probability
0 and so exactly 0. ``wo`` reads the FP8-rounded sum, not the sum of the float32 terms: what that
leaves is each head's ``attribution_src_rest``. The per-expert logit lens reads each chosen routed
expert's weighted output through the frozen norm and the head (:func:`lens_tokens`, and
:func:`expert_lens` at any position of a trace).

What the sparsity dropped: each head's update again with attention over every causal key instead of
the indexer's selection, from the same scores and values, through the same rounding to the
activation dtype and to FP8 before ``wo``, less the same recomputation with the model's own
probabilities (``attribution_dropped``, along u as every part). Both sides go through one
computation, so where the indexer keeps every visible key they are the same bits and the difference
is exactly 0.

Everything is read by forward hooks at one position, while the forward runs (weights are present
then, also when streamed); no model code path changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from model import fp8, kernels
from model.hooks import Hooks
from model.moe import MoE

from ..errors import InputError
from ..sites import LOGIT_LENS_TOPK, next_topk, site_name
from .heads import HeadReads, wo_columns
from .ranks import Ranks

Record = Callable[[dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class AttributionRequest:
    """Where and what to attribute: ``position`` (None: the last), ``target`` token id (None: the
    top prediction there, ``next.topk_indices[t, 0]``), optionally minus a ``contrast`` token's logit."""

    position: int | None = None
    target: int | None = None
    contrast: int | None = None

    def check(self, n_positions: int, vocab_size: int) -> None:
        """Before the run: ``n_positions`` counts the prompt and the tokens a generation may add."""
        if self.position is not None and not 0 <= self.position < n_positions:
            raise InputError(f"--position {self.position}: the run has positions 0..{n_positions - 1}")
        for flag, value in (("--target", self.target), ("--contrast", self.contrast)):
            if value is not None and not 0 <= value < vocab_size:
                raise InputError(f"{flag} {value} is outside the vocabulary (0..{vocab_size - 1})")


class Attributor:
    """Forward hooks that keep, at the attributed position, what each part is formed from, and at
    the head compute the parts (``record`` receives them by site name; ``info`` the resolved
    position, target and contrast).

    A run of several passes (a prefill, then decode steps) calls :meth:`begin_pass` before each:
    the hooks work in the pass that holds the position, and with the default position (the last)
    in every pass, so the run's last pass gives the values. ``reads`` (tracing.analyses.heads) adds the
    heads' split over key positions; ``lens`` the per-expert logit lens.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        request: AttributionRequest,
        hooks: Hooks,
        record: Record,
        reads: HeadReads | None = None,
        lens: bool = False,
        ranks: Ranks | None = None,
        dropped: bool = False,
    ):
        self.model = model
        self._ranks = ranks or Ranks()
        self.request = request
        self._record = record
        self._reads = reads
        self._lens = lens
        self.info: dict[str, int | None] = {}
        self._start = 0  # this pass's first position
        self._row: int | None = None  # the attributed position's row in this pass; None: not in this pass
        self._last = 0  # this pass's last row
        self._rows: dict[str, torch.Tensor] = {}
        points = [(model.norm, self._norm), (model.head, self._head)]
        for i, block in enumerate(model.layers):
            if dropped and getattr(block.attn, "indexer", None) is not None:  # a model without one drops nothing
                points.append((block.attn.scores, partial(self._scores, i)))
            points.append((block.attn.wo, partial(self._wo, i)))
            if isinstance(block.ffn, MoE):
                for name in ("gate.topk_indices", "expert_out", "shared_out"):
                    points.append((block.ffn.get_submodule(name), partial(self._keep, f"{i}.{name}")))
            else:
                points.append((block.ffn_out, partial(self._keep, f"{i}.mlp")))
        hooks.after(model.embed, self._embed)
        for module, fn in points:
            hooks.after(module, self._at_position(fn))

    def begin_pass(self, start_pos: int) -> None:
        self._start = start_pos

    def _at_position(self, fn):
        """``fn`` in the pass that holds the attributed position only."""

        def hook(module, inputs, output):
            if self._row is not None:
                fn(module, inputs, output)

        return hook

    def _embed(self, module, inputs, output) -> None:
        n_tokens = output.shape[1]
        self._last = n_tokens - 1
        t = self._start + self._last if self.request.position is None else self.request.position
        self._row = t - self._start if self._start <= t < self._start + n_tokens else None
        self._rows = {}
        if self._row is not None:
            self._rows["embed"] = output[0, self._row].to(self.model.dtype).float()  # (D,): the stream block 0 reads

    def _keep(self, name: str, module, inputs, output) -> None:
        row = output[0, self._row] if module.shape.startswith("B") else output[self._row]  # (T, ...) or (N, ...) -> (...)
        self._rows[name] = row.float() if row.is_floating_point() else row

    def _scores(self, layer: int, module, inputs, output) -> None:
        self._rows[f"{layer}.scores"] = output[0, self._row].clone()  # (H, S), the activation dtype, before any mask

    def _wo(self, layer: int, module, inputs, output) -> None:
        """Each head's update vector: its slice of wo's FP8-rounded input through its columns of the
        dequantised weight, in float32 (their sum is the float32 product before its bfloat16 rounding).
        With the sources: what each head summed over its keys, and wo's weight as stored (the target,
        and so the direction they are read along, is known only at the head)."""
        heads = self.model.layers[layer].attn.n_heads
        columns = wo_columns(module.weight, module.scale, heads)  # (D, H, Dv): this rank's heads under tensor parallelism
        vectors = _head_updates(module, columns, inputs[0][0, self._row])  # (H, D)
        self._rows[f"{layer}.heads"] = self._ranks.heads(vectors, layer)  # every head's
        if f"{layer}.scores" in self._rows:
            dropped = self._dropped_update(self._rows.pop(f"{layer}.scores"), module, inputs[0].dtype, columns)
            self._rows[f"{layer}.dropped"] = self._ranks.heads(dropped, layer)  # (H, D)
        if self._reads is not None:
            stored = (module.weight.detach().clone(), None if module.scale is None else module.scale.detach().clone())
            self._rows[f"{layer}.sources"] = (self._reads.sources(self._row), stored)  # (H, S, Dv), wo

    def _dropped_update(self, scores: torch.Tensor, wo, dtype: torch.dtype, columns: torch.Tensor) -> torch.Tensor:
        """(H, D): each head's update under dense attention less the same under the model's probabilities.

        The dense probabilities are MLA's softmax of the scores it saw, in their dtype, under the
        causal mask alone; a head whose probabilities are all 0 (ablated) reads nothing either way.
        Each side is ``sum_s p v`` rounded to the activation dtype, then for ``wo`` as its input is,
        and read through each head's columns as :meth:`_wo` reads the model's own."""
        sparse = self._reads.probs[self._row]  # (H, S) float32: after the masks and any intervention
        future = torch.arange(scores.shape[-1], device=scores.device) > self._start + self._row
        dense = scores.masked_fill(future, float("-inf")).softmax(dim=-1).float()  # (H, S)
        dense = torch.where(sparse.any(dim=-1, keepdim=True), dense, torch.zeros_like(dense))
        values = self._reads.values()  # (S, H, Dv)

        def update(p: torch.Tensor) -> torch.Tensor:
            x = kernels.einsum("hs,shv->hv", p, values).to(dtype).flatten()  # (H Dv,): what wo would read
            return _head_updates(wo, columns, x)  # (H, D)

        return update(dense) - update(sparse)

    def _norm(self, module, inputs, output) -> None:
        stream = inputs[0][0, self._row].float()  # (D,): the final stream, float32
        self._rows["scale"] = frozen_scale(module, stream)  # (D,)
        self._rows["normed"] = output[0, self._row]

    def _head(self, module, inputs, output) -> None:
        row = self._row
        if output.dim() == 3:  # every position's logits
            logits = output[0, row]
        elif row == self._last:  # the model's own logits of the pass's last position
            logits = output[0]
        else:
            logits = type(module).forward(module, self._rows["normed"][None].float())[0]  # (V,): the same head, at t
        self._finish(module, logits.float())

    def _finish(self, head, logits: torch.Tensor) -> None:
        request, rows = self.request, self._rows
        target = int(next_topk(logits)[0][0]) if request.target is None else request.target
        weight = head.dequantized(torch.float32)  # (V, D): this rank's rows where the vocabulary is split
        ids = [target] if request.contrast is None else [target, request.contrast]
        rows_of = self._ranks.vocab_rows(weight, ids)
        direction = rows_of[0] if request.contrast is None else rows_of[0] - rows_of[1]
        u = direction * rows["scale"]  # (D,): d logit / d stream, the norm's scale frozen
        total = logits[target] - (0 if request.contrast is None else logits[request.contrast])
        values = {"attribution.embed": (rows["embed"] @ u).reshape(1)}
        for i, block in enumerate(self.model.layers):
            heads = rows[f"{i}.heads"] @ u  # (H,)
            values[site_name(i, "attn.attribution")] = heads
            if f"{i}.dropped" in rows:
                values[site_name(i, "attn.attribution_dropped")] = rows[f"{i}.dropped"] @ u  # (H,)
            if f"{i}.sources" in rows:
                sources = self._ranks.heads(_sources(rows.pop(f"{i}.sources"), u), i)  # (H, S)
                values[site_name(i, "attn.attribution_src")] = sources
                values[site_name(i, "attn.attribution_src_rest")] = (heads.double() - sources.double().sum(-1)).float()
            if isinstance(block.ffn, MoE):
                parts = u.new_zeros(block.ffn.n_routed_experts + 1)  # (E + 1,): routed experts, then the shared
                slots = rows[f"{i}.gate.topk_indices"].sort().values  # expert_out's slots hold them ascending
                parts[slots] = rows[f"{i}.expert_out"] @ u
                parts[-1] = rows[f"{i}.shared_out"] @ u
                if self._lens:
                    ids, changes = lens_tokens(weight, rows[f"{i}.expert_out"] * rows["scale"], vocab=self._ranks.vocab)
                    values[site_name(i, "ffn.expert_lens.ids")] = _by_expert(ids, slots, block.ffn.n_routed_experts, -1)
                    values[site_name(i, "ffn.expert_lens.logits")] = _by_expert(changes, slots, block.ffn.n_routed_experts, 0)
            else:
                parts = (rows[f"{i}.mlp"] @ u).reshape(1)
            values[site_name(i, "ffn.attribution")] = parts
        summed = sum(float(v.double().sum()) for name, v in values.items() if _is_part(name))
        values["attribution.total"] = total.reshape(1)
        values["attribution.rest"] = (total.double() - summed).float().reshape(1)
        self.info = {"position": self._start + self._row, "target": target, "contrast": request.contrast}
        self._record(
            {name: v.detach().cpu() if not v.is_floating_point() else v.detach().float().cpu() for name, v in values.items()}
        )
        self._rows = {}


def removable(trace) -> list[tuple[float, str, int, int]]:
    """The parts of an attributed trace an intervention can remove alone, as (value, the
    ``tracing.analyses.intervention_specs.from_spec`` key that removes it, block, head or expert): each head
    (``ablate_heads``) and each chosen routed expert (``zero_experts``). For the causal check:
    removing a part of value p moves the logit by -p when nothing downstream reacts."""
    out = [
        (value, "ablate_heads", i, h)
        for i in trace.layers_with("attn.attribution")
        for h, value in enumerate(trace.site(i, "attn.attribution").tolist())
    ]
    for i in trace.layers_with("ffn.attribution"):
        values = trace.site(i, "ffn.attribution").tolist()
        out += [(value, "zero_experts", i, e) for e, value in enumerate(values[:-1]) if len(values) > 1 and value != 0.0]
    return out


def _is_part(name: str) -> bool:
    """The sites whose values sum, with the rest, to the total (not the sources, a split of the heads)."""
    return name == "attribution.embed" or name.endswith((".attn.attribution", ".ffn.attribution"))


def _head_updates(wo, columns: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(H, D): each head's slice of wo's input ``x`` (H Dv,), rounded as wo multiplies it (x itself
    where activations are not rounded), through its ``columns`` (D, H, Dv), in float32."""
    if wo.scale is not None and isinstance(read := wo.rounded(x[None]), fp8.Rounded):
        x = read.values()[0]
    return kernels.einsum("dhv,hv->hd", columns, x.float().view(columns.shape[1], -1))


def _sources(kept: tuple, u: torch.Tensor) -> torch.Tensor:
    """(H, S): each head's part from each key, ``p[t, h, s] v[s, h]`` through the head's columns of wo, along u."""
    summed, (weight, scale) = kept  # (H, S, Dv), wo as stored
    along = kernels.einsum("dhv,d->hv", wo_columns(weight, scale, summed.shape[0]), u)  # (H, Dv)
    return kernels.einsum("hsv,hv->hs", summed, along)


def frozen_scale(norm: torch.nn.Module, stream: torch.Tensor) -> torch.Tensor:
    """gamma / rms(x) of the final RMSNorm at a stream x (D,), float32: with it frozen, the head is linear in the stream."""
    return norm.weight.float() * torch.rsqrt(stream.float().pow(2).mean() + norm.eps)


def lens_tokens(
    head_weight: torch.Tensor, vectors: torch.Tensor, top: int = LOGIT_LENS_TOPK, vocab=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens each vector (k, D), already times the frozen norm scale, promotes (row 0) and
    suppresses (row 1) most through the head (V, D): ids and logit changes, each (k, 2, top).
    ``vocab`` makes the whole vocabulary's logits of this rank's (Ranks.vocab)."""
    logits = kernels.matmul(vectors.float(), head_weight.T)  # (k, V)
    if vocab is not None:
        logits = vocab(logits)
    up, down = logits.topk(top, dim=-1), logits.topk(top, dim=-1, largest=False)
    return torch.stack([up.indices, down.indices], dim=1), torch.stack([up.values, down.values], dim=1)


def _by_expert(values: torch.Tensor, slots: torch.Tensor, n_experts: int, fill: float) -> torch.Tensor:
    """(k, ...) rows of the chosen experts (ascending) as (E, ...) with ``fill`` for the others."""
    out = values.new_full((n_experts, *values.shape[1:]), fill)
    out[slots] = values
    return out


def expert_lens(
    model: torch.nn.Module, trace, block: int, position: int, expert: int, top: int = LOGIT_LENS_TOPK
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-expert logit lens at any (block, position): the tokens routed expert ``expert``'s
    weighted output promotes (row 0) and suppresses (row 1) most through the final norm, its scale
    frozen at the position's final stream, and the head. ids and logit changes, each (2, top).

    Reads the trace's ``ffn.expert_out`` and ``ffn.gate.topk_indices`` of the block and the last
    block's ``resid_post`` (record them: ``--record default,layers.*.ffn.expert_out,layers.*.resid_post``),
    and the loaded model's final norm and head."""
    last = trace.config.n_layers - 1
    needed = {
        "ffn.expert_out": trace.site(block, "ffn.expert_out"),
        "ffn.gate.topk_indices": trace.site(block, "ffn.gate.topk_indices"),
    }
    missing = [site_name(block, name) for name, value in needed.items() if value is None]
    stream = trace.site(last, "resid_post")
    if stream is None:
        missing.append(site_name(last, "resid_post"))
    if missing:
        raise InputError(f"the per-expert logit lens needs {', '.join(missing)} in the trace")
    if not 0 <= position < trace.n_tokens:
        raise InputError(f"position {position}: the trace has positions 0..{trace.n_tokens - 1}")
    slots = needed["ffn.gate.topk_indices"][position].sort().values
    if expert not in slots.tolist():
        raise InputError(f"expert {expert} was not chosen at position {position} in block {block}")
    if model.head.weight.is_meta:
        raise InputError("the per-expert logit lens needs the head's weights loaded (not a streamed model)")
    device = model.head.weight.device
    vector = needed["ffn.expert_out"][position, slots.tolist().index(expert)].to(device)  # (D,)
    scale = frozen_scale(model.norm, stream[position].to(device))
    ids, changes = lens_tokens(model.head.dequantized(torch.float32), (vector * scale)[None], top)
    return ids[0].cpu(), changes[0].cpu()
