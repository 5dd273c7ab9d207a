"""Decoding caches, owned by the caller: a model holds no per-request state, so threads can share it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class Buffer:
    """A sequence buffer (B, S, ...) that grows by doubling; writes must continue where it ends."""

    def __init__(self) -> None:
        self.data: torch.Tensor | None = None
        self.length = 0

    def write(self, start: int, value: torch.Tensor) -> torch.Tensor:
        """Store ``value`` (B, T, ...) at positions start..start+T; return positions 0..start+T."""
        if start > self.length:
            raise ValueError(f"cache holds {self.length} positions; cannot write at {start}")
        end = start + value.shape[1]
        data = self.data
        if data is None or data.shape[1] < end or data.shape[0] != value.shape[0] or data.dtype != value.dtype:
            grown = value.new_empty(value.shape[0], max(end, 2 * start, 16), *value.shape[2:])
            if data is not None and start:
                grown[:, :start] = data[:, :start]
            self.data = data = grown
        data[:, start:end] = value
        self.length = end
        return data[:, :end]


@dataclass
class LayerCache:
    kv: Buffer = field(default_factory=Buffer)  # MLA latent, after FP8 simulation (B, S, kv_lora_rank)
    pe: Buffer = field(default_factory=Buffer)  # RoPE part of the key (B, S, qk_rope_head_dim)
    index_k: Buffer = field(default_factory=Buffer)  # indexer keys, fp8 (B, S, index_head_dim)
    index_k_scale: Buffer = field(default_factory=Buffer)  # their scales (B, S, 1)


class Cache:
    """Per-layer caches for prefill followed by decode steps (``start_pos`` > 0)."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.mtp = LayerCache()  # the MTP module's block (model.mtp), when it runs
        # the main model's normalised hidden state at the last position of the pass before (B, 1, D):
        # the MTP entry of that position runs in the next pass, once the token after it is known
        self.mtp_hidden: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.layers[0].kv.length if self.layers else 0
