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

Everything is read by forward hooks at one position, while the forward runs (weights are present
then, also when streamed); no model code path changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from model import fp8
from model.moe import MoE

from .errors import InputError
from .sites import next_topk

Record = Callable[[dict[str, torch.Tensor]], None]


@dataclass(frozen=True)
class AttributionRequest:
    """Where and what to attribute: ``position`` (None: the last), ``target`` token id (None: the
    top prediction there, ``next.topk_indices[t, 0]``), optionally minus a ``contrast`` token's logit."""

    position: int | None = None
    target: int | None = None
    contrast: int | None = None

    def check(self, n_tokens: int, vocab_size: int) -> None:
        if self.position is not None and not 0 <= self.position < n_tokens:
            raise InputError(f"--position {self.position}: the prompt has positions 0..{n_tokens - 1}")
        for flag, value in (("--target", self.target), ("--contrast", self.contrast)):
            if value is not None and not 0 <= value < vocab_size:
                raise InputError(f"{flag} {value} is outside the vocabulary (0..{vocab_size - 1})")


class Attributor:
    """Forward hooks that keep, at the attributed position, what each part is formed from, and at
    the head compute the parts (``record`` receives them by site name; ``info`` the resolved
    position, target and contrast)."""

    def __init__(self, model: torch.nn.Module, request: AttributionRequest, mine: Callable[[], bool], record: Record):
        self.model = model
        self.request = request
        self._mine = mine
        self._record = record
        self.info: dict[str, int | None] = {}
        self._t = self._last = 0
        self._rows: dict[str, torch.Tensor] = {}

    def register(self) -> list:
        model = self.model
        hooks = [(model.embed, self._embed), (model.norm, self._norm), (model.head, self._head)]
        for i, block in enumerate(model.layers):
            hooks.append((block.attn.wo, partial(self._wo, i)))
            if isinstance(block.ffn, MoE):
                for name in ("gate.topk_indices", "expert_out", "shared_out"):
                    hooks.append((block.ffn.get_submodule(name), partial(self._keep, f"{i}.{name}")))
            else:
                hooks.append((block.ffn_out, partial(self._keep, f"{i}.mlp")))
        return [module.register_forward_hook(self._guarded(fn)) for module, fn in hooks]

    def _guarded(self, fn):
        def hook(module, inputs, output):
            if self._mine():
                fn(module, inputs, output)

        return hook

    def _embed(self, module, inputs, output) -> None:
        n_tokens = output.shape[1]
        self.request.check(n_tokens, self.model.args.vocab_size)
        self._last = n_tokens - 1
        self._t = self._last if self.request.position is None else self.request.position
        self._rows = {"embed": output[0, self._t].to(self.model.dtype).float()}  # (D,): the stream block 0 reads

    def _keep(self, name: str, module, inputs, output) -> None:
        row = output[0, self._t] if module.shape.startswith("B") else output[self._t]  # (T, ...) or (N, ...) -> (...)
        self._rows[name] = row.float() if row.is_floating_point() else row

    def _wo(self, layer: int, module, inputs, output) -> None:
        """Each head's update vector: its slice of wo's FP8-rounded input through its columns of the
        dequantised weight, in float32 (their sum is the float32 product before its bfloat16 rounding)."""
        x = inputs[0][0, self._t]  # (H Dv,)
        if module.scale is not None:
            x = fp8.act_dequant(*fp8.act_quant(x[None], module.scale_fmt))[0]
            weight = fp8.weight_dequant(module.weight, module.scale)  # (D, H Dv) float32
        else:
            weight = module.weight.float()
        heads = self.model.layers[layer].attn.n_heads
        cols = weight.view(weight.shape[0], heads, -1)  # (D, H, Dv)
        self._rows[f"{layer}.heads"] = torch.einsum("dhv,hv->hd", cols, x.float().view(heads, -1))  # (H, D)

    def _norm(self, module, inputs, output) -> None:
        stream = inputs[0][0, self._t].float()  # (D,): the final stream, float32
        self._rows["scale"] = module.weight.float() * torch.rsqrt(stream.pow(2).mean() + module.eps)  # gamma / rms
        self._rows["normed"] = output[0, self._t]

    def _head(self, module, inputs, output) -> None:
        t = self._t
        if output.dim() == 3:  # every position's logits
            logits = output[0, t]
        elif t == self._last:  # the model's own logits of the last position
            logits = output[0]
        else:
            logits = type(module).forward(module, self._rows["normed"][None].float())[0]  # (V,): the same head, at t
        self._finish(module, logits.float())

    def _finish(self, head, logits: torch.Tensor) -> None:
        request, rows = self.request, self._rows
        target = int(next_topk(logits)[0][0]) if request.target is None else request.target
        weight = head.dequantized(torch.float32)  # (V, D)
        direction = weight[target] if request.contrast is None else weight[target] - weight[request.contrast]
        u = direction * rows["scale"]  # (D,): d logit / d stream, the norm's scale frozen
        total = logits[target] - (0 if request.contrast is None else logits[request.contrast])
        values = {"attribution.embed": (rows["embed"] @ u).reshape(1)}
        for i, block in enumerate(self.model.layers):
            values[f"layers.{i}.attn.attribution"] = rows[f"{i}.heads"] @ u  # (H,)
            if isinstance(block.ffn, MoE):
                parts = u.new_zeros(block.ffn.n_routed_experts + 1)  # (E + 1,): routed experts, then the shared
                slots = rows[f"{i}.gate.topk_indices"].sort().values  # expert_out's slots hold them ascending
                parts[slots] = rows[f"{i}.expert_out"] @ u
                parts[-1] = rows[f"{i}.shared_out"] @ u
            else:
                parts = (rows[f"{i}.mlp"] @ u).reshape(1)
            values[f"layers.{i}.ffn.attribution"] = parts
        summed = sum(float(v.double().sum()) for v in values.values())
        values["attribution.total"] = total.reshape(1)
        values["attribution.rest"] = (total.double() - summed).float().reshape(1)
        self.info = {"position": self._t, "target": target, "contrast": request.contrast}
        self._record({name: value.detach().float().cpu() for name, value in values.items()})
        self._rows = {}
