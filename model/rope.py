"""Rotary position embedding with YaRN frequency interpolation."""

from __future__ import annotations

import math

import torch

from .config import ModelArgs


def precompute_freqs_cis(args: ModelArgs, seqlen: int, device: torch.device | str | None = None, start: int = 0) -> torch.Tensor:
    """e^{i t theta_j} for positions start <= t < seqlen: complex64 (seqlen - start, qk_rope_head_dim / 2).
    (The reference makes all max_seq_len positions once; each position's rotation is computed
    alone, so making only the positions a forward runs gives the same values.)

    With YaRN (when max_seq_len > original_seq_len, as the reference decides) the frequencies whose
    wavelength exceeds the original context are divided by rope_factor, with a linear ramp between
    beta_fast and beta_slow rotations.
    """
    dim, base, factor = args.qk_rope_head_dim, args.rope_theta, args.rope_factor

    def correction_dim(rotations: float) -> float:
        return dim * math.log(args.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (dim/2,)
    if args.use_yarn:
        low = max(math.floor(correction_dim(args.beta_fast)), 0)
        high = min(math.ceil(correction_dim(args.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        smooth = 1 - ramp
        freqs = freqs / factor * (1 - smooth) + freqs * smooth
    t = torch.arange(start, seqlen)
    angles = torch.outer(t, freqs)  # (T, dim/2)
    return torch.polar(torch.ones_like(angles), angles).to(device)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor, interleaved: bool = True) -> torch.Tensor:
    """Rotate x (B, T, H, R) by position. MLA pairs neighbours (interleaved); the indexer pairs
    dimension j with j + R/2 (not interleaved)."""
    dtype, shape = x.dtype, x.shape
    if not interleaved:
        x = x.view(*shape[:-1], 2, -1).transpose(-1, -2).contiguous()
    x = torch.view_as_complex(x.float().reshape(*shape[:-1], -1, 2))  # (B, T, H, R/2)
    y = torch.view_as_real(x * freqs_cis.view(1, x.size(1), 1, x.size(-1))).flatten(3)  # (B, T, H, R)
    if not interleaved:
        y = torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)
    return y.to(dtype)
