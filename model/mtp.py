"""The multi-token-prediction (MTP) module: a draft of the token after next.

DeepSeek-V3 trains one MTP module beside the main model (technical report, section 2.2); the
checkpoint stores it after the blocks, as ``model.layers.{n_layers}`` (layer 61 of the 671B model).
For position t, with ``h_t`` the main model's hidden state after its final norm (what the head
reads: the state vLLM's and SGLang's MTP drafters are handed) and ``e`` the embedding of the
token that follows t:

    h'_t   = eh_proj([enorm(e(token_{t+1})) ; hnorm(h_t)])     embedding first, hidden second
    s_t    = Block(h'_0 .. h'_t)                              one MoE block, causal, its own cache
    draft_t = softmax(head(norm(s_t)))                          the distribution of token_{t+2}

``eh_proj`` is a bf16 [dim, 2 dim] linear (the checkpoint has no scale for it), ``enorm``,
``hnorm`` and ``norm`` (``shared_head.norm``) are RMSNorms, the block is a block of the
main model's family (MLA with its own indexer, a router and experts), and the embedding and head are
the main model's (the checkpoint's ``embed_tokens`` and ``shared_head.head`` copies are the same
tensors; the loader checks them). The module holds no state of a run: its keys live in the caller's
:class:`~model.cache.Cache` (``cache.mtp``), with the last hidden state a decode step continues from.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import LayerCache
from .config import ModelArgs
from .hooks import HookPoint
from .linear import Linear
from .norm import RMSNorm
from .rope import precompute_freqs_cis


class MTP(nn.Module):
    """One MTP module: ``enorm``, ``hnorm``, ``eh_proj``, ``block``, ``norm``; the embedding and the
    head are passed in (the main model's)."""

    def __init__(
        self,
        layer_id: int,
        args: ModelArgs,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.bfloat16,
    ):
        from .transformer import transformer_class  # the transformer builds this module

        super().__init__()
        self.args = args
        self.dtype = dtype
        self.layer_id = layer_id  # its index in the checkpoint: model.layers.{layer_id}
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.eh_proj = Linear(2 * args.dim, args.dim, weight_dtype)  # bf16 in the checkpoint, no scale
        self.block = transformer_class(args).block_class(layer_id, args, dtype, weight_dtype)  # the family's
        self.norm = RMSNorm(args.dim, args.norm_eps)  # shared_head.norm
        self.logits = HookPoint("B T V")  # the draft's logits at each position it ran, float32

    def forward(
        self,
        hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        embed: nn.Module,
        head: nn.Module,
        start_pos: int,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """hidden: (B, T, D) the main model's normalised states at positions start_pos..start_pos+T-1;
        next_tokens: (B, T) the token after each. Returns float32 logits (B, T, V) of the token after
        that. The embedding and head run as their classes' forward without hooks, so hooks on the main
        model's own modules (the logit lens, next-token sites) see only the main model's pass, and a
        rank's vocabulary-parallel part (model.parallel) gathers as in the main pass."""
        seqlen = hidden.size(1)
        end_pos = start_pos + seqlen
        e = type(embed).forward(embed, next_tokens).to(self.dtype)  # (B, T, D); over ranks its vocabulary part, summed
        x = torch.cat([self.enorm(e, self.dtype), self.hnorm(hidden, self.dtype)], dim=-1)  # (B, T, 2D)
        x = self.eh_proj(x)  # (B, T, D): h'_t
        freqs_cis = precompute_freqs_cis(self.args, end_pos, hidden.device, start=start_pos)
        mask = torch.full((seqlen, end_pos), float("-inf"), device=hidden.device).triu_(start_pos + 1) if seqlen > 1 else None
        x, residual = self.block(x, None, start_pos, freqs_cis, mask, cache)
        stream = x.float() if residual is None else x.float() + residual.float()
        out = self.norm(stream, self.dtype)  # (B, T, D)
        return self.logits(type(head).forward(head, out.float()))  # (B, T, V)
