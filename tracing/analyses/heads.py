"""What each attention head read, kept by hooks for the analyses that split the attention update
over key positions (the attribution's sources, the contribution graph).

A head's output at query t is ``sum_s p[t, h, s] v[s, h]``: the probabilities come from the
``attn.probs`` hook point (after any intervention, so an ablated head reads nothing and a key the
indexer dropped has probability 0), the values from the prefill's ``wkv_b`` product, or, in the
decode path (which never forms them), from the cached latents through ``wkv_b``'s value rows as
the absorbed attention applies them. Only the block that is running is held.

Shapes: T query positions of this pass, S key positions, H heads, Dv v_head_dim, C kv_lora_rank.
"""

from __future__ import annotations

import inspect

import torch

from model import kernels
from model.attention import MLA
from model.cache import LayerCache
from model.hooks import Hooks

_FORWARD = inspect.signature(MLA.forward)


def wo_columns(weight: torch.Tensor, scale: torch.Tensor | None, heads: int) -> torch.Tensor:
    """wo's dequantised weight (D, H Dv) as each head's columns, (D, H, Dv) float32."""
    full = kernels.weight_dequant(weight, scale, torch.float32, keep=False)
    return full.view(full.shape[0], heads, -1)


class HeadReads:
    """Forward hooks on every block's attention that keep its probabilities and values."""

    def __init__(self, model: torch.nn.Module, hooks: Hooks):
        self.model = model
        self.block = -1
        self.probs: torch.Tensor | None = None  # (T, H, S) float32
        self._values: torch.Tensor | None = None  # (S, H, Dv), from the prefill's wkv_b
        self._cache: LayerCache | None = None
        for i, block in enumerate(model.layers):
            attn = block.attn
            hooks.before(attn, lambda m, args, kwargs, i=i: self._start(i, m, args, kwargs), with_kwargs=True)
            hooks.after(attn.probs, self._probs)
            hooks.after(attn.wkv_b, self._wkv_b)

    def _start(self, block: int, attn: MLA, args: tuple, kwargs: dict) -> None:
        self.block, self.probs, self._values = block, None, None
        self._cache = _FORWARD.bind(attn, *args, **kwargs).arguments.get("cache")  # MLA.forward's ``cache``, however passed

    def _probs(self, module, inputs, output) -> None:
        self.probs = output[0].float()  # (T, H, S)

    def _wkv_b(self, module, inputs, output) -> None:
        attn = self.model.layers[self.block].attn
        kv = output[0].view(output.shape[1], attn.n_heads, attn.qk_nope_head_dim + attn.v_head_dim)
        self._values = kv[..., attn.qk_nope_head_dim :].float()  # (S, H, Dv)

    def values(self) -> torch.Tensor:
        """(S, H, Dv) float32: the values every head of the running block read."""
        if self._values is not None:
            return self._values
        attn = self.model.layers[self.block].attn
        n_keys = self.probs.shape[-1]
        latent = self._cache.kv.data[0, :n_keys].float()  # (S, C): the cached FP8-rounded latents
        wkv_b = attn.wkv_b.dequantized(torch.float32).view(attn.n_heads, -1, attn.kv_lora_rank)  # (H, Dn + Dv, C)
        return kernels.einsum("sc,hvc->shv", latent, wkv_b[:, -attn.v_head_dim :])

    def sources(self, row: int) -> torch.Tensor:
        """(H, S, Dv): what each head's output at query ``row`` of this pass sums over its keys,
        ``p[t, h, s] v[s, h]`` in float32 (zero for a key of probability 0)."""
        p = self.probs[row]  # (H, S)
        return p[:, :, None] * self.values().transpose(0, 1)  # (H, S, Dv)
