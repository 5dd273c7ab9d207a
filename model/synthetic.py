"""Synthetic weights with the real names, shapes and dtypes, so the real-size path runs without
the 690 GB download, and tests get a random model of any config.

Each tensor is drawn from a generator seeded by (seed, its name), on the device asked for, so it is
the same whenever and wherever it is read (for one device type). Values are scaled like a trained
model's: FP8 weights use the e4m3 range with a block scale giving about 1/sqrt(fan_in) per element
(a power of two for ``scale_fmt: ue8m0``, as the real checkpoint; otherwise that times a random
factor, as amax/448 scales are); norm gains near one and the indexer's LayerNorm bias near zero;
the router's bias small and positive. Every value uses the full precision of its checkpoint dtype
(float32 norms, biases and scales are not rounded to bfloat16), so a load or a product that rounds
one shows up.
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import torch

from .checkpoint import TensorSpec, WeightSource, expected_specs, save_checkpoint
from .config import ConfigError, ModelArgs
from .fp8 import FP8

_FP8_STD = 64.0  # fp8 values ~ N(0, 64): well inside +-448 and with full precision


def v3_layout(args: ModelArgs) -> ModelArgs:
    """The same model in DeepSeek-V3's layout (V3, R1, V3.1): model_type deepseek_v3, no indexer
    and no indexer tensors, the norm gains stored in bfloat16."""
    return args.replace(indexer=False)


def write_synthetic_checkpoint(
    directory: str | os.PathLike,
    args: ModelArgs,
    seed: int = 0,
    n_shards: int = 2,
    extra_files: dict[str, str | os.PathLike] | None = None,
) -> Path:
    """A SyntheticSource of ``args`` saved as a Hugging Face checkpoint (config.json, index, shards),
    every tensor in its checkpoint dtype: ``write_synthetic_checkpoint(d, v3_layout(TINY))`` is a
    tiny DeepSeek-V3-layout checkpoint."""
    source = SyntheticSource(args, seed)
    tensors = {name: source.load(name) for name in source.specs()}
    return save_checkpoint(tensors, args, directory, n_shards=n_shards, extra_files=extra_files)


def truncate_layers(args: ModelArgs, n_layers: int) -> ModelArgs:
    """The first ``n_layers`` blocks of ``args`` (``--synthetic CONFIG --n-layers N``): the dense
    blocks among them stay dense, and each kept tensor has the same name, so a SyntheticSource of
    the result gives the same values as one of the whole model."""
    if not 0 < n_layers <= args.n_layers:
        raise ConfigError(f"--n-layers must be between 1 and {args.n_layers}, not {n_layers}")
    return args.replace(n_layers=n_layers, n_dense_layers=min(args.n_dense_layers, n_layers))


def synthetic_source(config: str | os.PathLike, n_layers: int | None = None, seed: int = 0) -> SyntheticSource:
    """A SyntheticSource for a config file (either JSON form), optionally cut to its first blocks."""
    args = ModelArgs.from_file(config)
    return SyntheticSource(truncate_layers(args, n_layers) if n_layers is not None else args, seed)


class SyntheticSource(WeightSource):
    """Deterministic tensors for every name :func:`expected_specs` lists for ``args``."""

    def __init__(self, args: ModelArgs, seed: int = 0):
        self.args = args
        self.seed = seed
        self._specs = expected_specs(args)

    def specs(self) -> dict[str, TensorSpec]:
        return self._specs

    def where(self, name: str) -> str:
        return f"synthetic:{name}"

    def _generator(self, name: str, device: torch.device) -> torch.Generator:
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + zlib.crc32(name.encode())) & 0x7FFF_FFFF_FFFF)
        return gen

    def load(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        spec = self._specs[name]
        device = torch.device(device)
        if device.type == "meta":  # shapes and dtypes only (meta kernels of the drawing ops are slow)
            return torch.empty(spec.shape, dtype=spec.dtype, device=device)
        if spec.dtype == FP8:
            return self._normal(name, spec.shape, device, _FP8_STD).clamp_(-448, 448).to(FP8)
        if name.endswith("weight_scale_inv"):
            fan_in = self._specs[name.replace("weight_scale_inv", "weight")].shape[1]
            # a power of two making dequantised weights ~ N(0, 1/fan_in)
            value = 2.0 ** round(math.log2(fan_in**-0.5 / _FP8_STD))
            scale = torch.full(spec.shape, value, dtype=torch.float32, device=device)
            if self.args.scale_fmt is None:  # amax/448-like: any float32 in [value, 2 value)
                scale = scale * (1 + torch.rand(spec.shape, generator=self._generator(name, device), device=device))
            return scale
        if name.endswith("e_score_correction_bias"):
            gen = self._generator(name, device)
            return (torch.rand(spec.shape, generator=gen, device=device) * 0.01).to(spec.dtype)
        if name.endswith("norm.weight") or "layernorm" in name:
            return (1 + self._normal(name, spec.shape, device, 0.1)).to(spec.dtype)
        if name.endswith("k_norm.bias"):
            return self._normal(name, spec.shape, device, 0.1).to(spec.dtype)
        std = 1.0 if "embed_tokens" in name else spec.shape[-1] ** -0.5
        return self._normal(name, spec.shape, device, std).to(spec.dtype)

    def _normal(self, name: str, shape: tuple[int, ...], device: torch.device, std: float) -> torch.Tensor:
        out = torch.empty(shape, dtype=torch.float32, device=device)
        return out.normal_(0.0, std, generator=self._generator(name, device))
