"""The Trace: what one prompt did in every block, and its file format (one .safetensors file).

Metadata (strings): ``format`` = ``deepseek-v32-trace``, ``version``, ``config`` (the reference's
JSON form), ``tokens`` (JSON list of token strings), ``prompt``, and ``extra`` (JSON: checkpoint,
dtype, patched sites, ...). Tensors are named by trace site; ``tokens`` holds the ids. A trace file
is data only: it is read with safetensors and validated, never unpickled.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes

from model.config import ConfigError, ModelArgs

from .sites import site_shape, site_shapes

FORMAT = "deepseek-v32-trace"
VERSION = "1"


class TraceError(ValueError):
    """An unreadable, foreign or inconsistent trace file."""


@dataclass
class Trace:
    """Recorded tensors (batch dimension dropped, floats as float32) with the run's context."""

    tensors: dict[str, torch.Tensor]
    config: ModelArgs
    tokens: list[str]
    prompt: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        return self.tensors["tokens"].tolist()

    @property
    def n_tokens(self) -> int:
        return len(self.tokens)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def layers_with(self, suffix: str) -> list[int]:
        """Block indices that have a site ``layers.{i}.{suffix}``, in order."""
        out = []
        for i in range(self.config.n_layers):
            if f"layers.{i}.{suffix}" in self.tensors:
                out.append(i)
        return out

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "config": json.dumps(
                {**self.config.to_reference(), "gate_bias": self.config.has_gate_bias, "norm_eps": self.config.norm_eps}
            ),
            "tokens": json.dumps(self.tokens, ensure_ascii=False),
            "prompt": self.prompt,
            "extra": json.dumps(self.extra),
        }

    def to_bytes(self) -> bytes:
        tensors = {name: t.contiguous() for name, t in self.tensors.items()}
        return _canonical(save_bytes(tensors, metadata=self.metadata()))

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: a temporary file beside the target, renamed when complete."""
        return write_atomic(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise TraceError(f"{path}: no such trace file")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise TraceError(f"{path}: not a readable trace file ({exc})") from None
        try:
            return cls.from_parts(tensors, meta)
        except TraceError as exc:
            raise TraceError(f"{path}: {exc}") from None

    @classmethod
    def from_bytes(cls, data: bytes, name: str = "upload") -> Trace:
        """A trace from a file's bytes (an upload), validated the same way."""
        with tempfile.NamedTemporaryFile(suffix=".safetensors") as tmp:
            tmp.write(data)
            tmp.flush()
            try:
                return cls.load(tmp.name)
            except TraceError as exc:
                raise TraceError(str(exc).replace(tmp.name, name)) from None

    @classmethod
    def from_parts(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Trace:
        if meta.get("format") != FORMAT:
            raise TraceError(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        if meta.get("version") != VERSION:
            raise TraceError(f"version {meta.get('version')!r} is not supported (this reads version {VERSION})")
        try:
            config = ModelArgs.from_reference(json.loads(meta["config"]))
            tokens = json.loads(meta["tokens"])
            extra = json.loads(meta.get("extra", "{}"))
        except (KeyError, ValueError, TypeError, ConfigError) as exc:
            raise TraceError(f"bad metadata ({exc})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise TraceError("metadata 'tokens' is not a list of strings")
        trace = cls(tensors, config, tokens, meta.get("prompt", ""), extra if isinstance(extra, dict) else {})
        trace.validate()
        return trace

    def validate(self) -> None:
        """Every tensor is a known site with the shape and dtype this config and prompt imply."""
        ids = self.tensors.get("tokens")
        if ids is None or ids.dim() != 1 or ids.dtype != torch.int64:
            raise TraceError("tensor 'tokens' must be int64 [T]")
        if len(ids) != len(self.tokens) or len(ids) == 0:
            raise TraceError(f"{len(ids)} token ids but {len(self.tokens)} token strings")
        shapes = site_shapes(self.config)
        n = len(ids)
        for name, tensor in self.tensors.items():
            if name == "tokens":
                continue
            if name not in shapes:
                raise TraceError(f"tensor {name!r} is not a trace site of this model")
            legend, dtype = shapes[name]
            want = site_shape(self.config, name, legend, n)
            if tuple(tensor.shape) != want:
                raise TraceError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
            if tensor.dtype != dtype:
                raise TraceError(f"tensor {name!r} has dtype {tensor.dtype}, expected {dtype}")


def _canonical(data: bytes) -> bytes:
    """The same file with its JSON header keys sorted: safetensors writes metadata in hash order,
    and the same trace must give the same bytes. Offsets are relative to the data, so they hold."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]


def write_atomic(path: str | os.PathLike, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
