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

from .sites import BLOCK_GROUPS, SAVED, SITE_GROUPS, index_range, layer_site, site_legend, site_name, site_shape

FORMAT = "deepseek-v32-trace"
VERSION = "1"

MAX_EXPERT_ROWS = 1 << 22  # MoE blocks held x experts: the rows of a table per block and expert (real: 58 x 256)


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

    def site(self, block: int, suffix: str) -> torch.Tensor | None:
        """Block ``block``'s value of the site ``layers.{i}.{suffix}`` (a registry row), or None when
        the trace does not hold it: the one place outside the registry that spells a block's site."""
        return self.tensors.get(site_name(block, suffix))

    def layers_with(self, suffix: str) -> list[int]:
        """Block indices that have a site ``layers.{i}.{suffix}``, in order: from the tensors held,
        not the config's block count."""
        return sorted(where[0] for name in self.tensors if (where := layer_site(name)) and where[1] == suffix)

    def tables(self) -> dict:
        """Tidy pandas DataFrames of what the trace holds, by table name (tracing.tables.tables):
        ``trace.tables()["router"]``."""
        from .tables import tables

        return tables(self)

    def metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "config": json.dumps(
                {
                    **self.config.to_reference(),
                    "gate_bias": self.config.has_gate_bias,
                    "norm_eps": self.config.norm_eps,
                    # the MTP module's sites (mtp.*) are a model with one's: said only then
                    **({"n_mtp_layers": self.config.n_mtp_layers} if self.config.n_mtp_layers else {}),
                }
            ),
            "tokens": json.dumps(self.tokens, ensure_ascii=False),
            "prompt": self.prompt,
            "extra": json.dumps(self.extra, allow_nan=False),
        }

    def to_bytes(self) -> bytes:
        tensors = {name: t.contiguous() for name, t in self.tensors.items()}
        return _canonical(save_bytes(tensors, metadata=self.metadata()))

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically (tracing.cli.output): a failure leaves no partial file, and a symlink, FIFO
        or device at ``path`` is refused rather than replaced."""
        from .cli.output import write_file

        return write_file(path, self.to_bytes())

    @classmethod
    def load(cls, path: str | os.PathLike) -> Trace:
        path = _regular(Path(path))
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
            data = json.loads(meta["config"])
            tokens = json.loads(meta["tokens"])
            extra = json.loads(meta.get("extra", "{}"))
        except (KeyError, ValueError, TypeError) as exc:
            raise TraceError(f"bad metadata ({exc})") from None
        except RecursionError:
            raise TraceError("bad metadata (JSON nested too deeply)") from None
        try:
            config = ModelArgs.from_reference(data)
        except (ValueError, TypeError, ConfigError) as exc:
            raise TraceError(f"bad metadata ({exc})") from None
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise TraceError("metadata 'tokens' is not a list of strings")
        trace = cls(tensors, config, tokens, meta.get("prompt", ""), extra if isinstance(extra, dict) else {})
        trace.validate()
        return trace

    def validate(self) -> None:
        """Every tensor is a known site with the shape, dtype and values this config and prompt
        imply, so that every reader may index with them. Checked tensor by tensor from the names the
        file holds: the cost follows the file's size, never the sizes its config claims (which
        ModelArgs bounds: model.config's MAX_LAYERS, MAX_EXPERT_MODULES, MAX_WIDTH)."""
        ids = self.tensors.get("tokens")
        if ids is None or ids.dim() != 1 or ids.dtype != torch.int64:
            raise TraceError("tensor 'tokens' must be int64 [T]")
        if len(ids) == 0:
            raise TraceError("the trace holds no token: nothing was traced")
        if len(ids) != len(self.tokens):
            raise TraceError(f"{len(ids)} token ids but {len(self.tokens)} token strings")
        _check_values("tokens", ids, 0, self.config.vocab_size)
        n = len(ids)
        for name, tensor in self.tensors.items():
            if name == "tokens":
                continue
            if name.startswith(SAVED):  # a graph's saved value (tracing.analyses.graph): its own shape
                if tensor.dtype != torch.float32 or tensor.dim() == 0:
                    raise TraceError(f"tensor {name!r} (a graph's saved value) must be float32 with a first axis")
                continue
            site = site_legend(self.config, name)
            if site is None:
                where = layer_site(name)
                blocks = f" (it has {self.config.n_layers} blocks)" if where and where[0] >= self.config.n_layers else ""
                raise TraceError(f"tensor {name!r} is not a trace site of this model{blocks}")
            legend, dtype = site
            want = site_shape(self.config, name, legend, n)
            if tuple(tensor.shape) != want:
                raise TraceError(f"tensor {name!r} has shape {list(tensor.shape)}, expected {list(want)}")
            if tensor.dtype != dtype:
                raise TraceError(f"tensor {name!r} has dtype {tensor.dtype}, expected {dtype}")
            if (bounds := index_range(self.config, name, n)) is not None:
                _check_values(name, tensor, *bounds)
        vocab = self.extra.get("vocab", {})
        if not isinstance(vocab, dict) or not all(isinstance(v, str) for v in vocab.values()):
            raise TraceError("metadata 'extra': 'vocab' is not a map of token ids to strings")
        _check_extra(self.extra, n)
        for site, about in self.extra.get("dictionaries", {}).items():  # a feature id indexes its dictionary
            if (ids := self.tensors.get(f"{site}.features.top_ids")) is not None:
                _check_values(f"{site}.features.top_ids", ids, -1, about["n_features"])
        _check_groups(self)
        _check_widths(self)


def _regular(path: Path) -> Path:
    """A trace is mapped from a regular file with data (tracing.cli.inputs.regular_file)."""
    from .cli.inputs import regular_file
    from .errors import InputError

    try:
        return regular_file(path, "trace file", mapped=True)
    except InputError as exc:
        raise TraceError(str(exc)) from None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_extra(extra: dict, n: int) -> None:
    """The run's records that the tables and pages read (tracing.tables.frames, app/topics): of the
    types and within the positions they index with."""
    fields = {
        "prefill": lambda v: _is_int(v) and 1 <= v <= n,
        "generation": lambda v: (
            isinstance(v, dict)
            and _is_int(v.get("start"))
            and 0 <= v["start"] <= n
            and _is_int(v.get("generated", 0))
            and v.get("generated", 0) >= 0
        ),
        "attribution": lambda v: (
            isinstance(v, dict)
            and all(v.get(k) is None or _is_int(v[k]) for k in ("position", "target", "contrast"))
            and (v.get("position") is None or 0 <= v["position"] < n)
        ),
        "dictionaries": lambda v: (
            isinstance(v, dict)
            and all(isinstance(d, dict) and _is_int(d.get("n_features")) and d["n_features"] > 0 for d in v.values())
        ),
        "nonfinite": lambda v: (
            isinstance(v, dict) and isinstance(v.get("site"), str) and (v.get("position") is None or _is_int(v["position"]))
        ),
    }
    for key, ok in fields.items():
        if key in extra and not ok(extra[key]):
            raise TraceError(f"metadata 'extra': {key!r} is not what a run records ({json.dumps(extra[key])[:80]})")


def _check_groups(trace: Trace) -> None:
    names = [(group, group) for group in SITE_GROUPS]
    for group in BLOCK_GROUPS:
        for block in sorted({b for suffix in group for b in trace.layers_with(suffix)}):
            names.append((group, tuple(site_name(block, suffix) for suffix in group)))
    for _, group in names:
        held = [name for name in group if name in trace.tensors]
        if held and len(held) < len(group):
            missing = next(name for name in group if name not in trace.tensors)
            raise TraceError(f"tensor {held[0]!r} comes with {missing!r}, which the file lacks")


def _check_widths(trace: Trace) -> None:
    """Tables of one row per block and expert (expert load) grow with the config's width, not the
    file: a file of one token in many blocks must not claim millions of rows."""
    blocks = len(trace.layers_with("ffn.gate.topk_indices"))
    if blocks * trace.config.n_routed_experts > MAX_EXPERT_ROWS:
        raise TraceError(
            f"{blocks} routed blocks of {trace.config.n_routed_experts} experts: more than {MAX_EXPERT_ROWS:,} "
            "block-expert rows, not a trace of a model this code traces"
        )


def _check_values(name: str, tensor: torch.Tensor, low: int, high: int) -> None:
    """Indices within their axis, so every reader may index with them."""
    bad = tensor[(tensor < low) | (tensor >= high)]
    if bad.numel():
        raise TraceError(f"tensor {name!r} holds {int(bad[0])}, outside {low}..{high - 1}")


def _canonical(data: bytes) -> bytes:
    """The same file with its JSON header keys sorted: safetensors writes metadata in hash order,
    and the same trace must give the same bytes. Offsets are relative to the data, so they hold."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    text = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data[8 + n :]
