"""Loading and saving weights in the Hugging Face layout of deepseek-ai/DeepSeek-V3.2-Exp.

A :class:`WeightSource` says which tensors it has (name -> shape, dtype) and reads one on demand.
:func:`load_model` builds the model on the meta device (a 671B model costs nothing there), checks
every tensor the model expects against the source, then assigns real tensors; :func:`materialize`
does the same for one sub-module, which is how streaming loads one block at a time.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import ConfigError, ModelArgs
from .names import STORED_BF16, from_hf, layer_of, to_hf
from .transformer import Transformer

INDEX = "model.safetensors.index.json"
_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}
_HIGH_PRECISION = (torch.bfloat16, torch.float16, torch.float32)


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor and what is wrong."""


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __str__(self) -> str:
        return f"{list(self.shape)} {dtype_name(self.dtype)}"


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a dtype (F8_E4M3, BF16, F32, ...)."""
    return _DTYPE_NAMES.get(dtype, str(dtype))


class WeightSource(ABC):
    """Where weights come from: a checkpoint directory, or a synthetic generator."""

    args: ModelArgs

    @abstractmethod
    def specs(self) -> Mapping[str, TensorSpec]:
        """Every tensor the source holds, by checkpoint name."""

    @abstractmethod
    def load(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        """One tensor by checkpoint name."""

    def where(self, name: str) -> str:
        """Where a tensor lives, for error messages."""
        return "the source"

    def nbytes(self, names: Iterable[str]) -> int:
        specs = self.specs()
        return sum(_numel(specs[n].shape) * specs[n].dtype.itemsize for n in names)

    @property
    def has_gate_bias(self) -> bool:
        """Whether the routers carry e_score_correction_bias: decided by the tensors, not the width."""
        return any(name.endswith(".mlp.gate.e_score_correction_bias") for name in self.specs())


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class SafetensorsSource(WeightSource):
    """A Hugging Face checkpoint directory, read lazily through memory maps: shards listed in
    model.safetensors.index.json, or one model.safetensors without an index."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a checkpoint directory")
        try:
            self.args = ModelArgs.from_file(self.directory / "config.json")
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self._handles: dict[str, object] = {}  # before the index: a single-file checkpoint is opened to list its tensors
        self._specs: dict[str, TensorSpec] | None = None
        self.weight_map = self._read_index()

    def _read_index(self) -> dict[str, str]:
        index = self.directory / INDEX
        if not index.exists():
            single = self.directory / "model.safetensors"
            if single.exists():
                return dict.fromkeys(self._open(single.name).keys(), single.name)
            raise CheckpointError(f"{self.directory}: no {INDEX} (and no model.safetensors)")
        try:
            data = json.loads(index.read_text())
            weight_map = data["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map is not a mapping of names to files")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a valid index ({exc})") from None
        for shard in sorted(set(weight_map.values())):
            if not (self.directory / shard).is_file():
                raise CheckpointError(f"{self.directory / shard}: shard listed in {INDEX} is missing")
        return weight_map

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            path = self.directory / shard
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
            self._handles[shard] = handle
        return handle

    def specs(self) -> dict[str, TensorSpec]:
        if self._specs is None:
            specs = {}
            by_shard: dict[str, list[str]] = {}
            for name, shard in self.weight_map.items():
                by_shard.setdefault(shard, []).append(name)
            for shard, names in sorted(by_shard.items()):
                handle = self._open(shard)
                present = set(handle.keys())
                for name in names:
                    if name not in present:
                        raise CheckpointError(f"{self.directory / shard}: tensor {name} listed in {INDEX} is not in the file")
                    piece = handle.get_slice(name)
                    dtype = _DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise CheckpointError(
                            f"{self.directory / shard}: tensor {name} has unsupported dtype {piece.get_dtype()}"
                        )
                    specs[name] = TensorSpec(tuple(piece.get_shape()), dtype)
            self._specs = specs
        return self._specs

    def where(self, name: str) -> str:
        return str(self.directory / self.weight_map.get(name, "?"))

    def load(self, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
        shard = self.weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"{self.directory}: tensor {name} is not in the checkpoint")
        try:
            tensor = self._open(shard).get_tensor(name)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{self.where(name)}: cannot read tensor {name} ({exc})") from None
        return tensor.to(device)

    def load_slice(self, name: str, dim: int, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start:stop of a tensor, reading only those bytes."""
        piece = self._open(self.weight_map[name]).get_slice(name)
        index = (slice(start, stop),) if dim == 0 else (slice(None), slice(start, stop))
        return piece[index].to(device)


def expected_specs(args: ModelArgs, gate_bias: bool | None = None) -> dict[str, TensorSpec]:
    """Every checkpoint tensor the model needs (MTP layer excluded): name -> shape and the dtype
    the checkpoint stores it in (the module's, but bfloat16 for names.STORED_BF16)."""
    with torch.device("meta"):
        model = Transformer(args, gate_bias=gate_bias)
    return {to_hf(name): TensorSpec(tuple(p.shape), stored_dtype(name, p.dtype)) for name, p in model.named_parameters()}


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The checkpoint dtype of the parameter ``name`` (module path) held in ``dtype``."""
    return torch.bfloat16 if name.endswith(STORED_BF16) and dtype == torch.float32 else dtype


def check_tensor(name: str, found: TensorSpec, want: TensorSpec, where: str) -> None:
    """Raise a CheckpointError unless ``found`` can stand for ``want`` (any float width for 16/32-bit weights)."""
    if found.shape != want.shape:
        raise CheckpointError(f"{where}: tensor {name} has shape {list(found.shape)}, expected {list(want.shape)}")
    same = found.dtype == want.dtype or (found.dtype in _HIGH_PRECISION and want.dtype in _HIGH_PRECISION)
    if not same:
        raise CheckpointError(f"{where}: tensor {name} has dtype {dtype_name(found.dtype)}, expected {dtype_name(want.dtype)}")


def validate(model: nn.Module, source: WeightSource, prefix: str = "") -> list[str]:
    """Check every parameter of ``model`` against the source; return the checkpoint names it needs."""
    specs = source.specs()
    needed = []
    for name, param in model.named_parameters(prefix=prefix.rstrip(".")):
        hf = to_hf(name)
        want = TensorSpec(tuple(param.shape), param.dtype)
        if hf not in specs:
            raise CheckpointError(f"{source.where(hf)}: tensor {hf} ({want}) is missing from the checkpoint")
        check_tensor(hf, specs[hf], want, source.where(hf))
        needed.append(hf)
    return needed


def materialize(
    module: nn.Module,
    source: WeightSource,
    device: torch.device | str = "cpu",
    prefix: str = "",
    skip: set[str] | None = None,
) -> int:
    """Replace ``module``'s parameters (named under ``prefix``) by the source's tensors; return bytes read."""
    total = 0
    for name, param in list(module.named_parameters(prefix=prefix.rstrip("."))):
        if skip and name in skip:
            continue
        hf = to_hf(name)
        tensor = source.load(hf, device)
        check_tensor(
            hf, TensorSpec(tuple(tensor.shape), tensor.dtype), TensorSpec(tuple(param.shape), param.dtype), source.where(hf)
        )
        total += tensor.numel() * tensor.element_size()
        owner = module
        local = name[len(prefix.rstrip(".")) + 1 :] if prefix else name
        *path, leaf = local.split(".")
        for part in path:
            owner = getattr(owner, part)
        owner._parameters[leaf] = nn.Parameter(tensor.to(param.dtype), requires_grad=False)
    return total


def build_model(
    args: ModelArgs,
    dtype: torch.dtype = torch.bfloat16,
    gate_bias: bool | None = None,
    weight_dtype: torch.dtype = torch.bfloat16,
) -> Transformer:
    """The model on the meta device: the structure, no memory."""
    with torch.device("meta"):
        return Transformer(args, dtype=dtype, weight_dtype=weight_dtype, gate_bias=gate_bias)


def load_model(
    source: WeightSource | str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
) -> Transformer:
    """A ready model from a checkpoint directory or any WeightSource."""
    if not isinstance(source, WeightSource):
        source = SafetensorsSource(source)
    model = build_model(source.args, dtype, gate_bias=source.has_gate_bias)
    needed = set(validate(model, source))
    _warn_unused(source, needed)
    materialize(model, source, device)
    return model.eval()


def _warn_unused(source: WeightSource, needed: set[str]) -> None:
    n_layers = source.args.n_layers
    unused = [n for n in source.specs() if n not in needed and not ((layer_of(n) or 0) >= n_layers)]
    if unused:
        warnings.warn(f"{len(unused)} checkpoint tensors are not used by the model, e.g. {unused[0]}", stacklevel=3)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names."""
    return {to_hf(name): p.detach() for name, p in model.named_parameters()}


def save_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    args: ModelArgs,
    directory: str | os.PathLike,
    n_shards: int = 2,
    extra_files: Mapping[str, str | os.PathLike] | None = None,
) -> Path:
    """Write tensors (checkpoint names) as config.json, an index and ``n_shards`` safetensors shards.

    Written into a temporary directory beside the target and renamed at the end, so a failure
    leaves nothing half-written; ``extra_files`` (name -> source path) are copied in (tokenizer).
    """
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()):
        raise FileExistsError(f"{directory}: exists and is not empty")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        names = sorted(tensors, key=_checkpoint_order)
        total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
        target = total / max(n_shards, 1)
        shards: list[list[str]] = [[]]
        size = 0
        for name in names:
            nbytes = tensors[name].numel() * tensors[name].element_size()
            if shards[-1] and size + nbytes > target * len(shards) and len(shards) < n_shards:
                shards.append([])
            shards[-1].append(name)
            size += nbytes
        weight_map = {}
        for i, shard_names in enumerate(shards):
            file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file({n: tensors[n].contiguous().cpu() for n in shard_names}, str(tmp / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard_names, file))
        (tmp / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(args.to_hf(), indent=2) + "\n")
        for name, path in (extra_files or {}).items():
            shutil.copyfile(path, tmp / name)
        if directory.exists():
            directory.rmdir()
        tmp.rename(directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def _checkpoint_order(name: str) -> tuple[int, str]:
    layer = layer_of(name)
    return (-1 if layer is None and "embed" in name else (layer if layer is not None else 1 << 30), name)


__all__ = [
    "CheckpointError",
    "SafetensorsSource",
    "TensorSpec",
    "WeightSource",
    "build_model",
    "check_tensor",
    "expected_specs",
    "from_hf",
    "hf_state_dict",
    "load_model",
    "materialize",
    "save_checkpoint",
    "validate",
]
