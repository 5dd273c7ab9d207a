"""Opening a model for tracing: a checkpoint directory (or the bundled demo), or synthetic weights."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from model.checkpoint import SafetensorsSource, WeightSource, load_model
from model.config import ModelArgs
from model.synthetic import SyntheticSource
from model.transformer import Transformer

from .errors import InputError
from .tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
DEMO = REPO / "assets" / "demo"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_checkpoint(value: str | Path) -> Path:
    """``demo`` names the bundled checkpoint; anything else is a directory."""
    return DEMO if str(value) == "demo" else Path(value).expanduser()


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InputError(f"--dtype {name!r}: choose bfloat16 or float32") from None


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name!r} is not a device (cpu or cuda)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available here")
    return device


def synthetic_source(config: str | Path, n_layers: int | None = None, seed: int = 0) -> SyntheticSource:
    args = ModelArgs.from_file(config)
    if n_layers is not None:
        if not 0 < n_layers <= args.n_layers:
            raise InputError(f"--n-layers {n_layers}: the config has {args.n_layers} blocks")
        args = args.replace(n_layers=n_layers, n_dense_layers=min(args.n_dense_layers, n_layers))
    return SyntheticSource(args, seed=seed)


@dataclass
class Loaded:
    """A model ready to trace, its tokenizer (None for synthetic weights) and where it came from."""

    model: Transformer
    tokenizer: Tokenizer | None
    source: WeightSource
    label: str


def open_checkpoint(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16) -> Loaded:
    directory = resolve_checkpoint(path)
    source = SafetensorsSource(directory)
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
    model = load_model(source, device, dtype)
    return Loaded(model, tokenizer, source, "demo" if directory == DEMO else str(directory))


def open_synthetic(config: str | Path, n_layers: int | None = None, device="cpu", dtype=torch.bfloat16) -> Loaded:
    source = synthetic_source(config, n_layers)
    return Loaded(load_model(source, device, dtype), None, source, f"synthetic:{config}")
