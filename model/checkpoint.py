"""Loading and saving weights in the Hugging Face layout of deepseek-ai/DeepSeek-V3.2-Exp.

A :class:`WeightSource` says which tensors it has (name -> shape, dtype) and reads one on demand.
:func:`load_model` builds the model on the meta device (a 671B model costs nothing there), checks
every tensor the model expects against the source, then assigns real tensors (:func:`materialize`,
for the model or any sub-module of it). :class:`TensorReader` reads a tensor, or one rank's range of
it, straight from the shards onto a device: the reads of streaming (``model.stream``) and of tensor
parallelism (``model.parallel``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import struct
import tempfile
import threading
import warnings
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .config import ConfigError, ModelArgs
from .files import CONFIG_BYTES, INDEX_BYTES, FileError, confined, read_json
from .names import FAMILIES, MTP_SHARED, from_hf, layer_of, to_hf
from .transformer import Transformer, transformer_class

if TYPE_CHECKING:
    from .parallel import Part

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
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


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

    def load_slice(self, name: str, dim: int, start: int, stop: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) start:stop of a tensor: one rank's part. Here the whole
        tensor is made and cut; a source that can read only those bytes does so instead."""
        return self.load(name, device).narrow(dim, start, stop - start).clone()

    def where(self, name: str) -> str:
        """Where a tensor lives, for error messages."""
        return "the source"

    def nbytes(self, names: Iterable[str]) -> int:
        specs = self.specs()
        return sum(numel_of(specs[n].shape) * specs[n].dtype.itemsize for n in names)


def numel_of(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


class SafetensorsSource(WeightSource):
    """A Hugging Face checkpoint directory, read lazily through memory maps: shards listed in
    model.safetensors.index.json, or one model.safetensors without an index.

    Every file it reads is confined to the directory (:func:`model.files.confined`), and the
    config's size is checked against the tensors the shards hold before anything is built."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"{self.directory}: not a checkpoint directory")
        try:
            self.args = ModelArgs.from_file(self._path("config.json"))
        except ConfigError as exc:
            raise CheckpointError(str(exc)) from None
        self.args = self.args.replace(eos_token_id=self._eos_ids())
        self._handles: dict[str, object] = {}  # before the index: a single-file checkpoint is opened to list its tensors
        self._specs: dict[str, TensorSpec] | None = None
        self.weight_map = self._read_index()
        if self.args.n_moe_layers:  # whether the routers carry a correction bias: the tensors say, not the config
            gate_bias = any(name.endswith(".mlp.gate.e_score_correction_bias") for name in self.weight_map)
            self.args = self.args.replace(gate_bias=gate_bias)
        self._check_extent()

    def _path(self, name: object) -> Path:
        """A file the checkpoint names, refused unless it lies inside the checkpoint directory."""
        try:
            return confined(self.directory, name)
        except FileError as exc:
            raise CheckpointError(f"{self.directory}: {exc}") from None

    def _json(self, name: str, what: str, max_bytes: int) -> Any:
        path = self._path(name)
        try:
            return read_json(path, max_bytes)
        except FileError as exc:
            raise CheckpointError(f"{path}: not a valid {what} ({exc})") from None

    def _eos_ids(self) -> tuple[int, ...]:
        """The config's end-of-sequence ids and generation_config.json's: generation stops at any of them."""
        ids = self.args.eos_token_id
        if (self.directory / "generation_config.json").exists():
            data = self._json("generation_config.json", "generation config", CONFIG_BYTES)
            extra = data.get("eos_token_id") if isinstance(data, dict) else None
            try:
                extra = self.args.replace(eos_token_id=extra).eos_token_id
            except ConfigError as exc:
                raise CheckpointError(f"{self.directory / 'generation_config.json'}: {exc}") from None
            ids += tuple(i for i in extra if i not in ids)
        return ids

    def _read_index(self) -> dict[str, str]:
        index = self._path(INDEX)
        if not index.exists():
            single = self._path("model.safetensors")
            if single.exists():
                return dict.fromkeys(self._open(single.name).keys(), single.name)
            raise CheckpointError(f"{self.directory}: no {INDEX} (and no model.safetensors)")
        data = self._json(INDEX, "index", INDEX_BYTES)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: not a valid index (weight_map is not a mapping of names to files)")
        for shard in sorted(set(weight_map.values())):
            if not self._path(shard).is_file():
                raise CheckpointError(f"{self.directory / shard}: shard listed in {INDEX} is missing")
        return weight_map

    def _check_extent(self) -> None:
        """Refuse a config with more blocks, or more routed experts per block, than the checkpoint
        holds tensors of, before a model of that size is built: even on the meta device every block
        and expert is a module in memory, so the cost of building stays that of the index."""
        held: dict[int, set[int]] = {}  # block -> routed experts with a tensor in it
        for name in self.weight_map:
            match = _EXPERT.match(name)
            layer = int(match.group(1)) if match else layer_of(name)
            if layer is not None and layer < self.args.n_layers:
                experts = held.setdefault(layer, set())
                if match:
                    experts.add(int(match.group(2)))
        config = self._path("config.json")
        for layer in range(self.args.n_layers):
            if layer not in held:
                raise CheckpointError(
                    f"{config}: describes {self.args.n_layers} blocks, the checkpoint holds no tensor of block {layer}"
                )
            n = len(held[layer])
            if self.args.is_moe(layer) and n < self.args.n_routed_experts:
                raise CheckpointError(
                    f"{config}: describes {self.args.n_routed_experts} routed experts per block, block {layer} of the"
                    f" checkpoint holds tensors of {n}"
                )

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            path = self._path(shard)
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


class TensorReader:
    """Reads checkpoint tensors (or one rank's part of them) onto a device, counting bytes.

    From a :class:`SafetensorsSource` a tensor, or a range of its rows, is read with ``pread``:
    the read happens here (in the loader thread, without the GIL), not later as page faults of a
    memory map in the thread that computes. For the CPU it is read straight into the tensor; for
    a GPU through reused (pinned) staging buffers, ``staging_bytes`` per reading thread in two
    halves, so each byte crosses PCIe from page-locked memory, no fresh host pages are faulted in,
    the next half is read while the last one is copied, and several threads read at once (no
    buffer is shared between them). Other sources go through ``load`` and ``load_slice``.
    """

    def __init__(self, source: WeightSource, staging_bytes: int = 64 << 20, staging: bool | None = None):
        self.source = source
        self.specs = source.specs()
        self.reads: Counter[str] = Counter()  # checkpoint name -> times read
        self.bytes_read = 0
        self.staging_bytes = staging_bytes  # per reading thread, in two halves
        self._staging = staging  # None: for devices other than the CPU
        self._local = threading.local()  # each reading thread's staging buffers
        self._direct = isinstance(source, SafetensorsSource)
        self._shards: dict[str, tuple[int, int, dict[str, Any]]] = {}  # shard -> (fd, data start, header)
        self._lock = threading.Lock()

    def direct(self, device: torch.device, part: Part | None = None) -> bool:
        """Whether :meth:`read` reads straight into host memory a caller may provide (``into``)."""
        staged = self._staging if self._staging is not None else device.type != "cpu"
        return self._direct and not staged and (part is None or part.dim == 0)

    def nbytes(self, name: str, part: Part | None = None) -> int:
        spec = self.specs[name]
        n = spec.dtype.itemsize
        for i, size in enumerate(spec.shape):
            n *= part.stop - part.start if (part is not None and i == 0) else size
        return n

    def read(
        self, name: str, device: torch.device | str, part: Part | None = None, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The tensor (or this rank's part of it) on ``device``. ``into``: a uint8 host buffer of
        :meth:`nbytes` to read into when :meth:`direct` (memory reused from a freed weight)."""
        spec = self.specs.get(name)
        if spec is None:
            raise CheckpointError(f"{self.source.where(name)}: tensor {name} is missing from the checkpoint")
        device = torch.device(device)
        if self._direct and (part is None or part.dim == 0):
            tensor = self._pread(name, spec, part, device, into)
        elif part is None:
            tensor = self.source.load(name, device)
        else:
            tensor = self.source.load_slice(name, part.dim, part.start, part.stop, device)
        tensor = tensor.to(device)
        with self._lock:
            self.reads[name] += 1
            self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def _pread(
        self, name: str, spec: TensorSpec, part: Part | None, device: torch.device, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        fd, start, header = self._shard(self.source.weight_map[name])
        entry = header.get(name)
        if entry is None:
            raise CheckpointError(f"{self.source.where(name)}: tensor {name} is not in the file")
        begin, end = entry["data_offsets"]
        shape = list(spec.shape)
        row_bytes = spec.dtype.itemsize
        for s in shape[1:]:
            row_bytes *= s
        if end - begin != row_bytes * (shape[0] if shape else 1):
            raise CheckpointError(f"{self.source.where(name)}: tensor {name} has {end - begin} bytes, expected {spec}")
        if part is not None:
            begin, shape[0] = begin + part.start * row_bytes, part.stop - part.start
        nbytes, offset = row_bytes * (shape[0] if shape else 1), start + begin
        staged = self._staging if self._staging is not None else device.type != "cpu"
        if not staged:
            raw = into if into is not None else torch.empty(nbytes, dtype=torch.uint8)
            self._fill(fd, memoryview(raw.numpy()), offset, name)
        else:
            raw = torch.empty(nbytes, dtype=torch.uint8, device=device)
            self._staged(fd, offset, raw, device, name)
        return raw.view(spec.dtype).reshape(shape)

    def _fill(self, fd: int, view: memoryview, offset: int, name: str) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.source.where(name)}: file ends inside tensor {name}")
            done += n

    def _staged(self, fd: int, offset: int, raw: torch.Tensor, device: torch.device, name: str) -> None:
        """Read into ``raw`` (on ``device``) through this thread's two staging buffers: while one
        half's copy to the device runs (asynchronously, from page-locked memory, on the thread's
        current stream), the next is read into the other. Returns when ``raw`` holds the bytes."""
        cuda = device.type == "cuda"
        stages = getattr(self._local, "stages", None)
        if stages is None:
            half = max(self.staging_bytes // 2, 1)
            stages = self._local.stages = [torch.empty(half, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        copied: list[Any] = [None, None]  # the event after each buffer's last copy
        for k, done in enumerate(range(0, len(raw), len(stages[0]))):
            stage, b = stages[k % 2], k % 2
            if copied[b] is not None:
                copied[b].synchronize()  # its previous copy has left the buffer
            n = min(len(stage), len(raw) - done)
            self._fill(fd, memoryview(stage.numpy())[:n], offset + done, name)
            raw[done : done + n].copy_(stage[:n], non_blocking=cuda)
            if cuda:
                copied[b] = torch.cuda.Event()
                copied[b].record()
        if cuda:
            torch.cuda.current_stream(device).synchronize()

    def locate(self, name: str) -> tuple[int, int, int]:
        """Where a tensor's bytes are in its shard: (open file descriptor, offset, length)."""
        fd, start, header = self._shard(self.source.weight_map[name])
        begin, end = header[name]["data_offsets"]
        return fd, start + begin, end - begin

    def _shard(self, shard: str) -> tuple[int, int, dict[str, Any]]:
        with self._lock:
            known = self._shards.get(shard)
            if known is None:
                path = self.source._path(shard)
                fd = os.open(path, os.O_RDONLY)
                (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, size, 8))
                known = self._shards[shard] = (fd, 8 + size, header)
            return known

    def close(self) -> None:
        with self._lock:
            for fd, _, _ in self._shards.values():
                os.close(fd)
            self._shards.clear()


def expected_specs(args: ModelArgs, mtp: bool = False) -> dict[str, TensorSpec]:
    """Every checkpoint tensor the model needs (the MTP layer only with ``mtp``, and then with its
    copies of the embedding and head): name -> shape and the dtype the checkpoint stores it in (the
    module's, but bfloat16 for its family's names.FAMILIES stored_bf16). Counted once per config and
    process, with the MTP layer, whose names are the layers past the model's; each call gets its
    own dict."""
    specs = _specs(args)
    return {n: s for n, s in specs.items() if mtp or (layer_of(n) or 0) < args.n_layers}


@functools.lru_cache(maxsize=8)
def _specs(args: ModelArgs) -> dict[str, TensorSpec]:
    """The MoE blocks after the first are alike, so the model is built on the meta device to its
    first MoE block, whose tensors stand for every later block's (building the 671B whole takes
    seconds); :func:`built_specs` is the same list from the whole model."""
    depth = min(args.n_dense_layers + 1, args.n_layers)
    return built_specs(args, depth)


def built_specs(args: ModelArgs, depth: int | None = None) -> dict[str, TensorSpec]:
    """The checkpoint's tensors (with the MTP layer) of the model built to its first ``depth`` blocks
    (all by default), block ``depth - 1``'s standing for each block after it, in the model's order."""
    depth = args.n_layers if depth is None else depth
    with torch.device("meta"):
        model = transformer_class(args)(args.replace(n_layers=depth, n_dense_layers=min(args.n_dense_layers, depth)), mtp=True)
    last = f"layers.{depth - 1}."
    specs, repeated = {}, []
    for name, p in [*model.named_parameters(), ("", None)]:  # a sentinel ends the repeated block
        if name.startswith(last):
            repeated.append((name.removeprefix(last), p))
            continue
        for i in range(depth - 1, args.n_layers) if repeated else ():
            for rest, q in repeated:
                specs[to_hf(f"layers.{i}.{rest}", args.n_layers)] = _spec(f"layers.{i}.{rest}", q, args)
        repeated.clear()
        if p is not None:
            specs[to_hf(name, args.n_layers)] = _spec(name, p, args)
    for name in mtp_copies(model):
        specs[to_hf(name, args.n_layers)] = specs[to_hf(name.split(".", 2)[2])]
    return specs


def _spec(name: str, p: torch.Tensor, args: ModelArgs) -> TensorSpec:
    return TensorSpec(tuple(p.shape), stored_dtype(name, p.dtype, args.model_type))


def mtp_copies(model: nn.Module) -> list[str]:
    """The module paths (mtp.{j}.embed.weight, mtp.{j}.head.weight) of the checkpoint's copies of
    the main embedding and head that an MTP module reads (it uses the main model's own)."""
    return [f"mtp.{j}.{ours}" for j in range(len(getattr(model, "mtp", ()))) for ours, _ in MTP_SHARED]


def stored_dtype(name: str, dtype: torch.dtype, model_type: str = "deepseek_v32") -> torch.dtype:
    """The checkpoint dtype of the parameter ``name`` (module path) held in ``dtype``, in the layout
    of ``model_type``'s family (names.FAMILIES)."""
    wider = FAMILIES[model_type].stored_bf16
    return torch.bfloat16 if name.endswith(wider) and dtype == torch.float32 else dtype


def check_tensor(name: str, found: TensorSpec, want: TensorSpec, where: str) -> None:
    """Raise a CheckpointError unless ``found`` can stand for ``want`` (any float width for 16/32-bit weights)."""
    if found.shape != want.shape:
        raise CheckpointError(f"{where}: tensor {name} has shape {list(found.shape)}, expected {list(want.shape)}")
    same = found.dtype == want.dtype or (found.dtype in _HIGH_PRECISION and want.dtype in _HIGH_PRECISION)
    if not same:
        raise CheckpointError(f"{where}: tensor {name} has dtype {dtype_name(found.dtype)}, expected {dtype_name(want.dtype)}")


def validate(model: nn.Module, source: WeightSource, prefix: str = "", parts: Mapping[str, Part] | None = None) -> list[str]:
    """Check every parameter of ``model`` against the source, before anything is read; return the
    checkpoint names it needs. A parameter in ``parts`` (module path -> this rank's part) holds
    that part of its tensor."""
    specs = source.specs()
    needed = []
    for name, param in model.named_parameters(prefix=prefix.rstrip(".")):
        hf = to_hf(name, source.args.n_layers)
        want = TensorSpec(tuple(param.shape), param.dtype)
        if hf not in specs:
            raise CheckpointError(f"{source.where(hf)}: tensor {hf} ({want}) is missing from the checkpoint")
        found = specs[hf]
        part = (parts or {}).get(name)
        if part is not None:
            shape = list(found.shape)
            shape[part.dim] = part.stop - part.start
            found = TensorSpec(tuple(shape), found.dtype)
        check_tensor(hf, found, want, source.where(hf))
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
        hf = to_hf(name, source.args.n_layers)
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
    args: ModelArgs, dtype: torch.dtype = torch.bfloat16, weight_dtype: torch.dtype = torch.bfloat16, mtp: bool = False
) -> Transformer:
    """The model on the meta device: the structure, no memory (the MTP module only with ``mtp``), of
    the family the config names (model.transformer.transformer_class)."""
    with torch.device("meta"):
        return transformer_class(args)(args, dtype=dtype, weight_dtype=weight_dtype, mtp=mtp)


def has_mtp(source: WeightSource) -> bool:
    """Whether the source holds the MTP module its config declares (block n_layers)."""
    n = source.args.n_layers
    return bool(source.args.n_mtp_layers) and any(layer_of(name) == n for name in source.specs())


def load_model(
    source: WeightSource | str | os.PathLike,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    mtp: bool | None = None,
) -> Transformer:
    """A ready model from a checkpoint directory or any WeightSource. ``mtp``: load the
    multi-token-prediction module (None: when the checkpoint holds one; False saves its memory, one
    MoE block)."""
    if not isinstance(source, WeightSource):
        source = SafetensorsSource(source)
    model = build_model(source.args, dtype, mtp=wants_mtp(source, mtp))
    needed = set(validate(model, source))
    _check_memory(source, needed, device)
    _warn_unused(source, needed)
    materialize(model, source, device)
    check_mtp_copies(model, source)
    return model.eval()


def wants_mtp(source: WeightSource, mtp: bool | None) -> bool:
    """Whether to build the MTP module: ``mtp`` None means when the checkpoint holds one."""
    if mtp and not has_mtp(source):
        raise CheckpointError(f"{source.where('config.json')}: the checkpoint holds no multi-token-prediction module")
    return has_mtp(source) if mtp is None else mtp


def check_mtp_copies(model: Transformer, source: WeightSource, parts: Mapping[str, Part] | None = None) -> None:
    """The MTP module reads the main embedding and head: the checkpoint's copies must be those (a
    rank compares its ``parts`` of them: the ranks together compare every row)."""
    for name in mtp_copies(model):
        ours = name.split(".", 2)[2]
        copy, main = to_hf(name, source.args.n_layers), to_hf(ours)
        part = (parts or {}).get(ours)
        read = source.load if part is None else (lambda n, p=part: source.load_slice(n, p.dim, p.start, p.stop))
        if copy in source.specs() and not torch.equal(read(copy), read(main)):
            raise CheckpointError(
                f"{source.where(copy)}: {copy} differs from {main}: an MTP module with its own embedding or head is"
                " not supported (load without the MTP module: --no-mtp)"
            )


def _check_memory(source: WeightSource, needed: set[str], device: torch.device | str) -> None:
    """Refuse, before the first allocation, weights that cannot fit in ``device``'s free memory: a
    config may describe any size (streaming, ``model.stream``, reads one block at a time)."""
    from .stream import available_memory  # stream builds on this module

    device = torch.device(device)
    if device.type == "meta":
        return
    nbytes, free = source.nbytes(needed), available_memory(device)
    if nbytes > free:
        raise CheckpointError(f"the weights take {_gib(nbytes)} and {device} has {_gib(free)} free: stream them instead")


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


def _warn_unused(source: WeightSource, needed: set[str]) -> None:
    n_layers = source.args.n_layers
    unused = [n for n in source.specs() if n not in needed and not ((layer_of(n) or 0) >= n_layers)]
    if unused:
        warnings.warn(f"{len(unused)} checkpoint tensors are not used by the model, e.g. {unused[0]}", stacklevel=3)


def hf_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters under their checkpoint names (an MTP module's with its copies of the
    embedding and head)."""
    n_layers = model.args.n_layers
    out = {to_hf(name, n_layers): p.detach() for name, p in model.named_parameters()}
    for name in mtp_copies(model):
        out[to_hf(name, n_layers)] = out[to_hf(name.split(".", 2)[2])].clone()  # a file holds no shared tensors
    return out


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
    "TensorReader",
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
