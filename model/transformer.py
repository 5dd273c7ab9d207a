"""DeepSeek-V3.2-Exp: embedding, blocks of MLA + (dense MLP | MoE), final norm and head.

A checkpoint's config chooses its family (:func:`transformer_class`, the table ``names.FAMILIES``):
this module's Transformer is V3.2-Exp's, model/v3.py's DeepSeek-V3's (R1, V3.1).

Shapes: B batch, T positions, D dim, V vocabulary.
"""

from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F
from torch import nn

from . import fp8
from .attention import MLA
from .cache import Cache, LayerCache
from .config import ModelArgs
from .hooks import HookPoint
from .linear import Linear
from .moe import MLP, MoE
from .mtp import MTP
from .names import FAMILIES
from .norm import RMSNorm
from .rope import precompute_freqs_cis


class Embedding(nn.Module):
    """Token embedding: a learned (V, D) table looked up by token id."""

    def __init__(self, vocab_size: int, dim: int, weight_dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        self.vocab_size = vocab_size
        self.dim = dim
        self.weight = nn.Parameter(torch.empty(vocab_size, dim, dtype=weight_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.embedding(x, self.weight)


class Block(nn.Module):
    """attn_norm, MLA, ffn_norm, FFN, with the residual adds where the reference has them: inside
    the next norm. Each add is formed in float32, named by a hook point (the residual stream),
    normalised, and carried on rounded to the activation dtype."""

    attention_class = MLA  # a family's own (model/v3.py: DeepSeek-V3's)
    mlp_class = MLP
    moe_class = MoE
    norm_class = RMSNorm

    def __init__(
        self,
        layer_id: int,
        args: ModelArgs,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__()
        linear = fp8.linear_dtype(args.dtype, weight_dtype)
        self.layer_id = layer_id
        self.dtype = dtype  # activations between the float32 sums
        self.attn = self.attention_class(args, weight_dtype)
        if layer_id < args.n_dense_layers:
            self.ffn = self.mlp_class(args.dim, args.inter_dim, linear, args.scale_fmt)
        else:
            self.ffn = self.moe_class(args, weight_dtype)
        self.attn_norm = self.norm_class(args.dim, args.norm_eps)
        self.ffn_norm = self.norm_class(args.dim, args.norm_eps)
        self.resid_pre = HookPoint("B T D")  # x_n, the stream entering the block (float32 sum)
        self.attn_out = HookPoint("B T D")  # the attention update
        self.resid_mid = HookPoint("B T D")  # x'_n = x_n + attention update (float32 sum)
        self.ffn_out = HookPoint("B T D")  # the FFN update
        self.resid_post = HookPoint("B T D")  # x_{n+1} = x'_n + FFN update (float32 sum)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        start_pos: int,
        freqs_cis: torch.Tensor,
        mask: torch.Tensor | None,
        cache: LayerCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x: the previous block's FFN update, or the stream itself when residual is None.
        Returns this block's FFN update and the stream it updates, as it received them."""
        x, residual = add_norm(self.attn_norm, self.resid_pre, x, residual, self.dtype)
        x = self.attn_out(self.attn(x, start_pos, freqs_cis, mask, cache))
        x, residual = add_norm(self.ffn_norm, self.resid_mid, x, residual, self.dtype)
        x = self.ffn_out(self.ffn(x))
        if self.resid_post.observed:  # this sum is otherwise first formed inside the next norm
            stream = x.float() + residual.float()
            if (patched := self.resid_post(stream)) is not stream:
                return like(patched, stream), None
        return x, residual


def add_norm(
    norm: RMSNorm, point: HookPoint, x: torch.Tensor, residual: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's fused ``norm(x, residual)``: the stream x + residual in float32, normalised;
    returns (normalised, stream), both in ``dtype``. ``point`` sees, and may replace, the stream."""
    stream = x.float() if residual is None else x.float() + residual.float()  # (B, T, D) float32
    if (patched := point(stream)) is not stream:
        stream = like(patched, stream)
    return norm(stream, dtype), stream.to(dtype)


def like(value: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """A hook's replacement of ``reference``, refused in one line unless it has its shape."""
    if value.shape != reference.shape:
        raise ValueError(f"a hook replaced a {tuple(reference.shape)} value with shape {tuple(value.shape)}")
    return value.to(dtype=reference.dtype, device=reference.device)


class Transformer(nn.Module):
    """The whole model. ``forward`` returns float32 logits of the last position (B, V), or of
    every position (B, T, V) with ``all_logits``. Decoding continues at ``start_pos`` from the
    earlier positions' keys: pass the :class:`Cache` they were written to (:meth:`new_cache`). The
    model holds no state of a run (the reference keeps its caches in module buffers), so threads can
    share it.

    ``dtype`` is the activation dtype (bfloat16 as the reference, or float32); ``weight_dtype`` the
    dtype of the weights the reference holds in bfloat16: the embedding, the router and the linears
    that are not FP8. Norms, ``weights_proj`` and the head are float32 whatever it is, as the
    reference's modules (README, Numerics: the dtype audit).

    The model of a config is ``transformer_class(args)(args)``: this class refuses another family's.
    """

    block_class = Block  # a family's own (model/v3.py: DeepSeek-V3's)
    norm_class = RMSNorm

    def __init__(
        self,
        args: ModelArgs,
        dtype: torch.dtype = torch.bfloat16,
        weight_dtype: torch.dtype = torch.bfloat16,
        mtp: bool = False,
    ):
        super().__init__()
        if (family := transformer_class(args)) is not type(self):
            raise TypeError(f"a {args.model_type} config builds {family.__module__}.{family.__qualname__}")
        # ``mtp``: build the checkpoint's multi-token-prediction module (model.mtp, when the config has
        # one); without it ``args`` says the model has none (n_mtp_layers 0), and mtp_skipped that the
        # checkpoint did
        self.mtp_skipped = bool(args.n_mtp_layers) and not mtp
        self.args = args = args.replace(n_mtp_layers=0) if self.mtp_skipped else args
        self.dtype = dtype
        self.embed = Embedding(args.vocab_size, args.dim, weight_dtype)
        self.layers = nn.ModuleList([self.block_class(i, args, dtype, weight_dtype) for i in range(args.n_layers)])
        self.norm = self.norm_class(args.dim, args.norm_eps)
        # float32 as the reference holds it (the checkpoint stores bf16): logits are formed in float32
        self.head = Linear(args.dim, args.vocab_size, torch.float32)
        self.logits = nn.Module()
        self.logits.last = HookPoint("B V")  # logits of the last position, float32
        self.logits.all = HookPoint("B T V")  # every position's logits, when asked for
        # the first MTP module (model.layers.{n_layers} in the checkpoint); run only when asked for or
        # observed, so the default forward is the main model's alone
        self.mtp = nn.ModuleList([MTP(args.n_layers, args, dtype, weight_dtype)] if args.n_mtp_layers else [])

    def new_cache(self) -> Cache:
        return Cache(len(self.layers))

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: int = 0,
        cache: Cache | None = None,
        all_logits: bool = False,
        mtp: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``mtp``: also run the MTP module and return (logits, its draft logits) (:meth:`draft`);
        it runs, without being returned, whenever a hook observes it (a trace of its sites)."""
        seqlen = tokens.size(1)
        end_pos = start_pos + seqlen
        if cache is None and start_pos:
            raise ValueError(f"start_pos {start_pos}: a decode step continues the Cache (new_cache()) of the earlier positions")
        device = tokens.device
        freqs_cis = precompute_freqs_cis(self.args, end_pos, device, start=start_pos)
        # the reference masks only when several positions run at once; one position sees all keys
        mask = torch.full((seqlen, end_pos), float("-inf"), device=device).triu_(start_pos + 1) if seqlen > 1 else None
        h, residual = self.embed(tokens).to(self.dtype), None  # (B, T, D)
        for i, layer in enumerate(self.layers):
            h, residual = layer(h, residual, start_pos, freqs_cis, mask, None if cache is None else cache.layers[i])
        h = self.final_norm(h, residual)  # (B, T, D) in the activation dtype
        if all_logits:
            logits = self.logits.all(self.head(self.head_input(h)).float())  # (B, T, V)
            self.logits.last(logits[:, -1])
        else:
            logits = self.logits.last(self.head(self.head_input(h[:, -1])).float())  # (B, V)
        if self.mtp and (mtp or self.mtp[0].logits.observed):
            drafts = self.draft(tokens, h, logits[:, -1] if all_logits else logits, start_pos, cache)
            if mtp:
                return logits, drafts
        return logits

    def final_norm(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """The last block's stream (its update plus the stream it updated, in float32), normalised."""
        return self.norm(h.float() if residual is None else h.float() + residual.float(), self.dtype)

    def head_input(self, normed: torch.Tensor) -> torch.Tensor:
        """What the head reads of the normalised states: float32 (a float32 product, float32 logits)."""
        return normed.float()

    def draft(
        self, tokens: torch.Tensor, h: torch.Tensor, last: torch.Tensor, start_pos: int, cache: Cache | None
    ) -> torch.Tensor:
        """The MTP module's logits (B, T', V) for the token after next, at positions q0..start_pos+T-1
        with q0 = start_pos - 1 in a decode step (that position's entry waited for this pass's token)
        and 0 in a prefill. ``h``: this pass's normalised states (B, T, D); ``last``: its last position's
        logits. The last position's entry reads the greedy next token (the best of ``last``, as
        tracing.sites.next_topk orders them): the next pass runs it again with the token chosen."""
        greedy = last.topk(min(10, last.shape[-1]), dim=-1).indices[:, :1]  # (B, 1)
        if start_pos:
            if cache is None or cache.mtp_hidden is None:
                raise ValueError(f"start_pos {start_pos}: the MTP module continues from a pass that ran it (the same Cache)")
            hidden, following, first = torch.cat([cache.mtp_hidden, h], dim=1), torch.cat([tokens, greedy], dim=1), start_pos - 1
        else:
            hidden, following, first = h, torch.cat([tokens[:, 1:], greedy], dim=1), 0
        if cache is not None:
            cache.mtp_hidden = h[:, -1:]
        return self.mtp[0](hidden, following, self.embed, self.head, first, None if cache is None else cache.mtp)


def transformer_class(args: ModelArgs) -> type[Transformer]:
    """The Transformer of the family ``args`` belongs to (``names.FAMILIES[args.model_type]``)."""
    return importlib.import_module(f".{FAMILIES[args.model_type].module}", __package__).Transformer
