"""Intervention graphs: a small declarative program over trace sites that travels as JSON (and its
constant tensors as safetensors), so an idea runs on a model in this process and on a model server
alike; hook functions (tracing.analyses.interventions.HookFunctions) run only where the model is.

    g = Graph()
    x = g.read("layers.2.resid_post", positions=[-1])
    g.add("layers.3.resid_pre", x * 4.0, positions="3:")
    g.save("steer_norm", x.norm())
    trace = tracing.load("demo").run("It is a truth", graph=g, generate=8)

A graph is a list of operations, each naming its value (``id``) and the values it uses, which
must come before it. ``read`` takes a hook point's value (rows by position, heads or experts
chosen), ``const`` a number, a list or a tensor, the arithmetic makes new values, ``write`` puts a
value into a hook point (replace or add) and ``save`` records one into the trace as
``graph.<name>``. The format, its limits and how positions resolve during generation are in
docs/graphs.md; :class:`GraphRun` carries a graph out on the hook points, as every intervention
does (tracing never edits a model code path).
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from model.config import ModelArgs

from ..errors import InputError
from ..sites import SAVED, site_legend, site_shape, spec
from .interventions import Intervention, PassContext, Replace

VERSION = 1
MAX_OPS = 256  # operations in one graph
MAX_INLINE_ELEMENTS = 65536  # numbers written out in the JSON, all constants together
MAX_TENSOR_ELEMENTS = 1 << 24  # elements of the constant tensors, all together
MAX_TENSOR_BYTES = 64 * 2**20  # bytes of the constant tensors, all together
MAX_INDICES = 4096  # entries of one positions, heads or experts list
MAX_JSON_BYTES = 4 * 2**20  # a graph file's JSON
MAX_DIMS = 4  # axes of a constant
MIN_VALUE_LIMIT = 1 << 20  # a value may hold this many numbers, or as many as the largest site or constant it uses
WIRE = "graph/"  # a constant tensor's name in a request's safetensors body: graph/<name>
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")

# each operation's fields: "ref" a value's id, "num" a finite number, "ref|num" either, "site", "positions",
# "ids" (heads or experts), "name" (a save's), "mode", "value" (a const's numbers), "tensor" (a constant's name)
VALUE_OPS: dict[str, dict[str, str]] = {
    "read": {"site": "site", "positions": "positions", "heads": "ids", "experts": "ids"},
    "const": {"value": "value", "tensor": "tensor"},
    "add": {"x": "ref", "y": "ref|num"},
    "sub": {"x": "ref", "y": "ref|num"},
    "mul": {"x": "ref", "y": "ref|num"},
    "scale": {"x": "ref", "by": "num"},
    "mean": {"x": "ref"},
    "norm": {"x": "ref"},
    "project": {"x": "ref", "onto": "ref"},
    "project_out": {"x": "ref", "onto": "ref"},
    "clamp": {"x": "ref", "min": "num", "max": "num"},
}
EFFECT_OPS: dict[str, dict[str, str]] = {
    "write": {"site": "site", "value": "ref", "mode": "mode", "positions": "positions", "heads": "ids", "experts": "ids"},
    "save": {"name": "name", "value": "ref"},
}
REQUIRED = {
    "read": ("site",),
    "add": ("x", "y"),
    "sub": ("x", "y"),
    "mul": ("x", "y"),
    "scale": ("x", "by"),
    "mean": ("x",),
    "norm": ("x",),
    "project": ("x", "onto"),
    "project_out": ("x", "onto"),
    "clamp": ("x",),
    "write": ("site", "value"),
    "save": ("name", "value"),
}


# --- positions ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Positions:
    """Positions of the run: ``listed`` (each absolute, or from the newest token when negative: -1 is
    the newest) or a half-open range ``start:stop`` (Python's slice over the positions so far, either
    end negative or absent). None (not this class) is every position."""

    listed: tuple[int, ...] | None = None
    start: int | None = None
    stop: int | None = None

    @classmethod
    def parse(cls, what: str, value: Any) -> Positions | None:
        if value is None:
            return None
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, list | tuple):
            if not value or len(value) > MAX_INDICES or not all(_is_int(p) and abs(p) < 2**31 for p in value):
                raise InputError(f"{what}: positions are a list of 1 to {MAX_INDICES} integers, or a range 'A:B'")
            return cls(listed=tuple(value))
        if not isinstance(value, str):
            raise InputError(f"{what}: positions are a list of integers or a range 'A:B', not {type(value).__name__}")
        first, sep, stop = value.strip().partition(":")
        if not sep:
            if not _is_number(first):
                raise InputError(f"{what}: positions {value!r}: expected P, A:B, A: or :B (negative: from the newest)")
            return cls(listed=(int(first),))
        if not (first == "" or _is_number(first)) or not (stop == "" or _is_number(stop)):
            raise InputError(f"{what}: positions {value!r}: expected P, A:B, A: or :B (negative: from the newest)")
        return cls(start=int(first) if first else None, stop=int(stop) if stop else None)

    def to_json(self) -> list[int] | str:
        if self.listed is not None:
            return list(self.listed)
        return f"{'' if self.start is None else self.start}:{'' if self.stop is None else self.stop}"

    def resolve(self, n: int) -> list[int]:
        """The absolute positions among 0..n-1 (n: the positions so far; n-1 the newest), in order."""
        if self.listed is None:
            return list(range(n))[slice(self.start, self.stop)]
        return [q for p in self.listed if 0 <= (q := p if p >= 0 else n + p) < n]


def _resolve(positions: Positions | None, n: int) -> list[int]:
    return list(range(n)) if positions is None else positions.resolve(n)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(text: str) -> bool:
    digits = text.removeprefix("-")
    return digits.isascii() and digits.isdigit() and len(digits) <= 9


def _is_num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# --- the builder --------------------------------------------------------------------------------------
class Value:
    """A value of a graph being built: Python's operators and these methods add operations."""

    def __init__(self, graph: Graph, id: str):
        self.graph, self.id = graph, id

    def _binary(self, op: str, other: Value | float) -> Value:
        if isinstance(other, Value):
            self.graph._own(other)
            return self.graph._op(op, x=self.id, y=other.id)
        if not _is_num(other):
            raise InputError(f"graph {op}: expected a graph value or a finite number, not {type(other).__name__}")
        return self.graph._op(op, x=self.id, y=other)

    def __add__(self, other):
        return self._binary("add", other)

    __radd__ = __add__

    def __sub__(self, other):
        return self._binary("sub", other)

    def __rsub__(self, other):
        return (self * -1.0) + other

    def __mul__(self, other):
        if isinstance(other, Value):
            return self._binary("mul", other)
        return self.scale(other)

    __rmul__ = __mul__

    def __truediv__(self, other: float):
        if not _is_num(other) or other == 0:
            raise InputError("graph: a value is divided by a finite non-zero number only")
        return self.scale(1.0 / other)

    def __neg__(self):
        return self.scale(-1.0)

    def scale(self, by: float) -> Value:
        if not _is_num(by):
            raise InputError(f"graph scale: expected a finite number, not {by!r}")
        return self.graph._op("scale", x=self.id, by=by)

    def mean(self) -> Value:
        """The mean over the rows (positions): one row."""
        return self.graph._op("mean", x=self.id)

    def norm(self) -> Value:
        """The L2 norm over the last axis (kept, of size 1)."""
        return self.graph._op("norm", x=self.id)

    def project(self, onto: Value) -> Value:
        """The part along ``onto`` (a direction over the last axis)."""
        self.graph._own(onto)
        return self.graph._op("project", x=self.id, onto=onto.id)

    def project_out(self, onto: Value) -> Value:
        """What is left once the part along ``onto`` is taken out."""
        self.graph._own(onto)
        return self.graph._op("project_out", x=self.id, onto=onto.id)

    def clamp(self, min: float | None = None, max: float | None = None) -> Value:
        bounds = {k: v for k, v in (("min", min), ("max", max)) if v is not None}
        return self.graph._op("clamp", x=self.id, **bounds)

    def __repr__(self) -> str:
        return f"Value({self.id!r})"


class Graph:
    """An intervention graph: ``ops`` (plain JSON values, checked as they are added) and the constant
    tensors they name (``tensors``, by name). Build one with the methods, or read one with
    :meth:`from_json` / :meth:`load`."""

    def __init__(self, ops: Sequence[Mapping[str, Any]] = (), tensors: Mapping[str, torch.Tensor] | None = None):
        self.ops: list[dict[str, Any]] = []
        self.tensors: dict[str, torch.Tensor] = {}
        self._inline = 0  # numbers written out in the JSON so far
        self._digests: dict[str, str] = {}  # each constant tensor's SHA-256, once
        for name, tensor in (tensors or {}).items():
            self._add_tensor(name, tensor)
        for op in ops:
            self._append(dict(op) if isinstance(op, Mapping) else op)
        self._check_tensors_used()

    # building ------------------------------------------------------------------------------------
    def read(self, site: str, positions=None, heads=None, experts=None) -> Value:
        """A hook point's value: rows by position (first axis), then its own axes (batch dropped)."""
        fields = {"site": site, "positions": _positions_json(positions), "heads": heads, "experts": experts}
        return self._op("read", **{k: v for k, v in fields.items() if v is not None})

    def constant(self, value, name: str | None = None) -> Value:
        """A number, a (nested) list written into the JSON, or a tensor kept beside it (``name``)."""
        if isinstance(value, torch.Tensor):
            name = name or f"t{len(self.tensors)}"
            self._add_tensor(name, value)
            return self._op("const", tensor=name)
        return self._op("const", value=value)

    def replace(self, site: str, value: Value, positions=None, heads=None, experts=None) -> None:
        """The model uses ``value`` at ``site`` (at these positions, heads or experts) instead of its own."""
        self._write("replace", site, value, positions, heads, experts)

    def add(self, site: str, value: Value, positions=None, heads=None, experts=None) -> None:
        """The model uses its own value at ``site`` plus ``value``."""
        self._write("add", site, value, positions, heads, experts)

    def save(self, name: str, value: Value) -> None:
        """Record ``value`` into the trace as ``graph.<name>``."""
        self._own(value)
        self._append({"op": "save", "name": name, "value": value.id})

    def _write(self, mode, site, value, positions, heads, experts) -> None:
        if not isinstance(value, Value):
            value = self.constant(value)
        self._own(value)
        fields = {"positions": _positions_json(positions), "heads": heads, "experts": experts}
        self._append(
            {"op": "write", "site": site, "value": value.id, "mode": mode, **{k: v for k, v in fields.items() if v is not None}}
        )

    def _op(self, op: str, **fields) -> Value:
        id = f"v{len(self.ops)}"
        while id in self._ids():
            id += "_"
        self._append({"op": op, "id": id, **fields})
        return Value(self, id)

    def _own(self, value: Value) -> None:
        if not isinstance(value, Value) or value.graph is not self:
            raise InputError("graph: a value of another graph (or not a graph value) cannot be used here")

    # reading and checking ------------------------------------------------------------------------
    def _ids(self) -> set[str]:
        return {op["id"] for op in self.ops if "id" in op}

    def _append(self, op: Any) -> None:
        """One operation, checked against the ones before it (no model needed)."""
        where = f"graph op {len(self.ops)}"
        if len(self.ops) >= MAX_OPS:
            raise InputError(f"the graph has more than {MAX_OPS} operations")
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise InputError(f'{where}: expected an object with "op" (one of {", ".join([*VALUE_OPS, *EFFECT_OPS])})')
        kind = op["op"]
        fields = VALUE_OPS.get(kind) or EFFECT_OPS.get(kind)
        if fields is None:
            raise InputError(f"{where}: unknown op {kind[:40]!r}; choose from {', '.join([*VALUE_OPS, *EFFECT_OPS])}")
        where += f" ({kind})"
        allowed = {"op", *fields, *(("id",) if kind in VALUE_OPS else ())}
        if unknown := sorted(set(op) - allowed):
            raise InputError(f"{where}: unknown field {unknown[0][:40]!r} (it takes {', '.join(sorted(allowed - {'op'}))})")
        for key in REQUIRED.get(kind, ()):
            if key not in op:
                raise InputError(f"{where}: {key!r} is missing")
        ids = self._ids()
        if kind in VALUE_OPS:
            id = op.get("id")
            if not isinstance(id, str) or not _NAME.fullmatch(id):
                raise InputError(f"{where}: 'id' must be a name (letters, digits, _ . -, at most 64)")
            if id in ids:
                raise InputError(f"{where}: id {id!r} is used twice")
        for key, kind_of in fields.items():
            if key in op:
                _check_field(where, key, kind_of, op[key], ids, self)
        if kind == "const" and ("value" in op) == ("tensor" in op):
            raise InputError(f"{where}: give 'value' (numbers) or 'tensor' (a constant tensor's name), one of them")
        if kind == "clamp" and "min" not in op and "max" not in op:
            raise InputError(f"{where}: give 'min', 'max' or both")
        if kind == "clamp" and "min" in op and "max" in op and op["min"] > op["max"]:
            raise InputError(f"{where}: min {op['min']} is above max {op['max']}")
        if kind == "save" and op["name"] in {o["name"] for o in self.ops if o["op"] == "save"}:
            raise InputError(f"{where}: the name {op['name']!r} is saved twice")
        inline = self._inline + (_constant(op["value"], where).numel() if kind == "const" and "value" in op else 0)
        if inline > MAX_INLINE_ELEMENTS:
            raise InputError(f"{where}: the inline constants hold more than {MAX_INLINE_ELEMENTS:,} numbers")
        if kind == "write":
            _check_write_site(where, op["site"])
        self.ops.append(op)
        self._inline = inline

    def _add_tensor(self, name: str, tensor: torch.Tensor) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InputError(f"graph tensor {name!r}: a name of letters, digits, _ . - (at most 64)")
        if name in self.tensors:
            raise InputError(f"graph tensor {name!r} is given twice")
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in FLOAT_DTYPES:
            got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise InputError(f"graph tensor {name!r} is {got}: a constant is float32, bfloat16, float16 or float64")
        if tensor.dim() > MAX_DIMS:
            raise InputError(f"graph tensor {name!r} has {tensor.dim()} axes; at most {MAX_DIMS}")
        elements = sum(t.numel() for t in self.tensors.values()) + tensor.numel()
        size = sum(t.numel() * t.element_size() for t in self.tensors.values()) + tensor.numel() * tensor.element_size()
        if elements > MAX_TENSOR_ELEMENTS or size > MAX_TENSOR_BYTES:
            raise InputError(
                f"graph tensor {name!r}: the constants would hold {elements:,} numbers, {size / 2**20:.3g} MiB "
                f"(at most {MAX_TENSOR_ELEMENTS:,}, {MAX_TENSOR_BYTES / 2**20:.3g} MiB)"
            )
        if not torch.isfinite(tensor).all():
            raise InputError(f"graph tensor {name!r} holds NaN or infinite values")
        self.tensors[name] = tensor.detach().cpu()

    def _check_tensors_used(self) -> None:
        used = {op["tensor"] for op in self.ops if op["op"] == "const" and "tensor" in op}
        if unused := sorted(set(self.tensors) - used):
            raise InputError(f"graph tensor {unused[0]!r} is used by no operation")

    def check(self) -> Graph:
        """What needs no model: something to do. (Every operation was checked as it was added.)"""
        if not any(op["op"] in EFFECT_OPS for op in self.ops):
            raise InputError("the graph writes and saves nothing: add a write (replace or add) or a save")
        return self

    # JSON ---------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the tensors travel beside it: a file next to it, or the request's safetensors)."""
        return {"graph": VERSION, "ops": [dict(op) for op in self.ops]}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: Any, tensors: Mapping[str, torch.Tensor] | None = None) -> Graph:
        if not isinstance(data, dict):
            raise InputError('a graph is a JSON object {"graph": 1, "ops": [...]}')
        if unknown := sorted(set(data) - {"graph", "ops", "tensors"}):
            raise InputError(f"graph: unknown field {unknown[0][:40]!r} (it takes graph, ops, tensors)")
        if data.get("graph") != VERSION:
            raise InputError(f'graph: expected "graph": {VERSION} (the format\'s version), not {str(data.get("graph"))[:20]}')
        ops = data.get("ops")
        if not isinstance(ops, list):
            raise InputError("graph: 'ops' must be a list of operations")
        if len(ops) > MAX_OPS:
            raise InputError(f"the graph has {len(ops)} operations; at most {MAX_OPS}")
        return cls(ops, tensors)

    @classmethod
    def from_json(cls, text: str | bytes, tensors: Mapping[str, torch.Tensor] | None = None) -> Graph:
        return cls.from_dict(_parsed(text, "the graph"), tensors)

    @classmethod
    def from_file(cls, text: bytes | str, beside: Callable[[str], bytes], where: str = "the graph") -> Graph:
        """A graph file's JSON; the safetensors file its ``"tensors"`` names is ``beside(name)``'s bytes
        (read from the same directory, or an upload of that name)."""
        data = _parsed(text, where)
        tensors = None
        if isinstance(data, dict) and data.get("tensors") is not None:
            name = data["tensors"]
            if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
                raise InputError(f"{where}: 'tensors' names a .safetensors file beside the graph (no directory)")
            tensors = _read_tensors(beside(name), name)
        try:
            return cls.from_dict(data, tensors)
        except InputError as exc:
            raise InputError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | Path) -> Graph:
        """A graph file; its ``"tensors"`` names a safetensors file beside it holding the constants."""
        from ..cli.inputs import regular_file

        path = regular_file(path, "graph file", limit=MAX_JSON_BYTES)

        def beside(name: str) -> bytes:
            limit = MAX_TENSOR_BYTES + MAX_JSON_BYTES  # the tensors and their header
            return regular_file(path.parent / name, "graph tensors file", limit=limit, mapped=True).read_bytes()

        return cls.from_file(path.read_bytes(), beside, str(path))

    def save_file(self, path: str | Path) -> Path:
        """Write the graph's JSON (and its tensors beside it, ``<stem>.safetensors``)."""
        from safetensors.torch import save_file

        path = Path(path)
        data = self.to_dict()
        if self.tensors:
            data["tensors"] = path.with_suffix(".safetensors").name
            save_file({k: v.contiguous() for k, v in self.tensors.items()}, str(path.with_suffix(".safetensors")))
        ops = ",\n".join("  " + json.dumps(op) for op in data.pop("ops"))  # one operation a line
        head = "".join(f"{json.dumps(k)}: {json.dumps(v)}, " for k, v in data.items())
        path.write_text("{" + head + '"ops": [\n' + ops + "\n]}\n")
        return path

    def describe(self) -> str:
        writes = [f"{op['mode']} {op['site']}" for op in self.ops if op["op"] == "write"]
        saves = [op["name"] for op in self.ops if op["op"] == "save"]
        parts = [*(["writes " + ", ".join(writes)] if writes else []), *(["saves " + ", ".join(saves)] if saves else [])]
        return f"graph of {len(self.ops)} ops: " + "; ".join(parts)

    def record(self) -> dict[str, Any]:
        """What a trace says was done to it: the graph's JSON and each constant tensor's shape and digest."""
        for name, t in self.tensors.items():
            if name not in self._digests:
                self._digests[name] = hashlib.sha256(t.float().contiguous().numpy().tobytes()).hexdigest()
        tensors = {name: {"shape": list(t.shape), "sha256": self._digests[name]} for name, t in sorted(self.tensors.items())}
        return {**self.to_dict(), **({"tensors": tensors} if tensors else {})}

    def fingerprint(self) -> str:
        """One digest of the graph and its tensors: the same program, the same string."""
        return hashlib.sha256(json.dumps(self.record(), sort_keys=True).encode()).hexdigest()[:16]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Graph) and self.fingerprint() == other.fingerprint()

    def __hash__(self) -> int:
        return hash(self.fingerprint())

    def __repr__(self) -> str:
        return f"Graph({self.describe()})"


def _read_tensors(data: bytes, name: str) -> dict[str, torch.Tensor]:
    """The constants of a safetensors file's bytes (data only: never unpickled)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) > MAX_TENSOR_BYTES + MAX_JSON_BYTES:
        raise InputError(f"{name}: {len(data):,} bytes, more than a graph's constants hold")
    try:
        return load(data)
    except (SafetensorError, ValueError, RuntimeError, OSError) as exc:
        raise InputError(f"{name}: not a readable safetensors file ({str(exc)[:120]})") from None


def _parsed(text: str | bytes, where: str) -> Any:
    """A graph's JSON, bounded, with NaN and Infinity refused (JSON has no such numbers)."""
    if len(text) > MAX_JSON_BYTES:
        raise InputError(f"{where}: {len(text):,} bytes, more than a graph's JSON holds ({MAX_JSON_BYTES:,})")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise InputError(f"{where}: the graph is not JSON ({str(exc)[:120]})") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number a graph holds")


def _positions_json(positions) -> list[int] | str | None:
    if positions is None:
        return None
    parsed = Positions.parse("positions", positions)
    return parsed.to_json()


def _check_field(where: str, key: str, kind: str, value: Any, ids: set[str], graph: Graph) -> None:
    if kind == "ref" or (kind == "ref|num" and isinstance(value, str)):
        if not isinstance(value, str) or value not in ids:
            shown = value[:40] if isinstance(value, str) else type(value).__name__
            raise InputError(f"{where}: {key!r} names {shown!r}, which no operation before it made (use after define)")
    elif kind in ("num", "ref|num"):
        if not _is_num(value):
            raise InputError(f"{where}: {key!r} must be a finite number")
    elif kind == "site":
        if not isinstance(value, str) or len(value) > 200:
            raise InputError(f"{where}: {key!r} must be a site name")
        _check_site(where, value)
    elif kind == "positions":
        Positions.parse(where, value)
    elif kind == "ids":
        if not isinstance(value, list) or not value or len(value) > MAX_INDICES:
            raise InputError(f"{where}: {key!r} is a list of 1 to {MAX_INDICES} ids")
        if not all(_is_int(i) and 0 <= i < 2**31 for i in value) or len(set(value)) != len(value):
            raise InputError(f"{where}: {key!r} must hold distinct non-negative integers")
    elif kind == "name":
        if not isinstance(value, str) or not _NAME.fullmatch(value):
            raise InputError(f"{where}: {key!r} must be a name (letters, digits, _ . -, at most 64)")
    elif kind == "mode":
        if value not in ("replace", "add"):
            raise InputError(f'{where}: \'mode\' is "replace" or "add"')
    elif kind == "value":
        _constant(value, where)
    elif kind == "tensor":
        if not isinstance(value, str) or value not in graph.tensors:
            shown = value[:40] if isinstance(value, str) else type(value).__name__
            have = ", ".join(sorted(graph.tensors)[:8]) or "none"
            raise InputError(f"{where}: tensor {shown!r} is not among the graph's tensors ({have})")


def _check_site(where: str, name: str) -> None:
    row = spec(name)
    if row is None or not row.patchable or row.computed:
        raise InputError(f"{where}: {name[:80]!r} is not a hook point (docs/cli.md lists the trace sites)")
    if row.blocks == "mtp":  # it runs the position before each pass's first again: its rows are not the pass's
        raise InputError(f"{where}: {name!r} is the MTP module's draft, outside a graph's reach")


def _check_write_site(where: str, name: str) -> None:
    if spec(name).dtype != torch.float32:
        raise InputError(f"{where}: {name!r} holds integers (a selection): a graph writes float sites")


def _constant(value: Any, where: str) -> torch.Tensor:
    """An inline constant as a float32 tensor: a finite number or a rectangular nested list of them."""
    depth, probe = 0, value
    while isinstance(probe, list):
        depth += 1
        if depth > MAX_DIMS or not probe:
            raise InputError(f"{where}: a constant is a number or a non-empty list of at most {MAX_DIMS} levels")
        probe = probe[0]
    try:
        tensor = torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InputError(f"{where}: a constant is a number or a rectangular list of numbers") from None
    if tensor.dim() != depth or not torch.isfinite(tensor).all():
        raise InputError(f"{where}: a constant holds finite numbers in a rectangular list")
    return tensor


# --- running it -------------------------------------------------------------------------------------
def _axes(name: str) -> list[str]:
    return [a for a in spec(name).legend.split() if a != "B"]


def _position_axis(name: str) -> bool:
    return _axes(name)[0] in ("T", "N")


def _picked(name: str, value: torch.Tensor, op: Mapping) -> torch.Tensor:
    """``value`` (rows first, batch dropped) at the op's heads and experts."""
    axes = _axes(name)
    for key, letter in (("heads", "H"), ("experts", "E")):
        if key in op:
            dim = axes.index(letter) + (0 if _position_axis(name) else 1)
            value = value.index_select(dim, torch.tensor(op[key], device=value.device))
    return value


@dataclass
class _State:
    """One run's memory: each read's rows of every pass so far (a generation's later steps read the
    earlier positions), the saved values by pass, and this pass's evaluated values."""

    reads: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)  # id -> [(first position, rows)]
    saved: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    start: int = -1
    n: int = 0  # positions so far, this pass's included
    values: dict[str, torch.Tensor | None] = field(default_factory=dict)
    fired: set[str] = field(default_factory=set)  # reads whose hook point ran in this pass
    done: set[int] = field(default_factory=set)  # saves evaluated in this pass

    def prune(self, program: Program) -> None:
        """Drop the rows no pass from now on can read (before each read's :meth:`Program.keep_from`)."""
        for id, parts in self.reads.items():
            if not parts or not _position_axis(program.ops[program.by_id[id]]["site"]):
                self.reads[id] = parts[-1:]
                continue
            oldest = program.keep_from(id, self.n)
            self.reads[id] = [
                (max(first, oldest), rows[max(0, oldest - first) :]) for first, rows in parts if first + len(rows) > oldest
            ]


class Program:
    """A checked graph against one model: evaluates its values in a pass and tells where each
    operation acts. The same code runs on meta tensors to check shapes before any model work."""

    def __init__(self, graph: Graph, args: ModelArgs):
        graph.check()
        self.graph, self.args = graph, args
        self.max_elements: int | None = None  # the most numbers a value may hold (check_graph sets it)
        self.ops = graph.ops
        self.by_id = {op["id"]: i for i, op in enumerate(self.ops) if "id" in op}
        self.positions = {i: Positions.parse("", op.get("positions")) for i, op in enumerate(self.ops) if "positions" in op}
        for i, op in enumerate(self.ops):
            if "site" in op:
                self._check_model_site(i, op)
            if op["op"] == "save" and not self.reads_of(i):
                raise InputError(f"{self.where(i)}: {op['name']!r} is made of constants alone: save a value made from a read")
        self.consts = {
            op["id"]: (graph.tensors[op["tensor"]].float() if "tensor" in op else _constant(op["value"], ""))
            for op in self.ops
            if op["op"] == "const"
        }

    def where(self, i: int) -> str:
        return f"graph op {i} ({self.ops[i]['op']})"

    def _check_model_site(self, i: int, op: Mapping) -> None:
        name, args = op["site"], self.args
        if site_legend(args, name) is None:
            raise InputError(f"{self.where(i)}: this model has no site {name!r}")
        axes = _axes(name)
        if "positions" in op and not _position_axis(name):
            raise InputError(f"{self.where(i)}: {name!r} holds the newest position only: it takes no positions")
        for key, letter, count, what in (
            ("heads", "H", args.index_n_heads if ".indexer." in name else args.n_heads, "heads"),
            ("experts", "E", args.n_routed_experts, "experts"),
        ):
            if key in op:
                if letter not in axes:
                    raise InputError(f"{self.where(i)}: {name!r} has no {what} axis")
                if max(op[key]) >= count:
                    raise InputError(f"{self.where(i)}: {what} are numbered 0..{count - 1}")

    def reads_of(self, i: int) -> set[str]:
        """The ids of the reads operation ``i`` depends on."""
        out, todo = set(), [i]
        while todo:
            op = self.ops[todo.pop()]
            if op["op"] == "read":
                out.add(op["id"])
            todo.extend(self.by_id[v] for k, v in op.items() if k in ("x", "y", "onto", "value") and isinstance(v, str))
        return out

    def value(self, id: str, state: _State, device) -> torch.Tensor | None:
        """The value ``id`` names in this pass (None when a read it uses has no row here)."""
        if id in state.values:
            return state.values[id]
        i = self.by_id[id]
        op = self.ops[i]
        kind = op["op"]
        if kind == "read":
            got = self._rows(op, state)
        elif kind == "const":
            got = self.consts[id].to(device)
        else:
            x = self.value(op["x"], state, device)
            other = op.get("y", op.get("onto"))
            y = self.value(other, state, device) if isinstance(other, str) else other
            got = None if x is None or (isinstance(other, str) and y is None) else self._compute(i, kind, op, x, y)
        if got is not None and self.max_elements is not None and got.numel() > self.max_elements:
            raise InputError(
                f"{self.where(i)}: its value would hold {got.numel():,} numbers ({list(got.shape)}), more than the"
                f" largest value it reads ({self.max_elements:,}): a broadcast across two position axes?"
            )
        state.values[id] = got
        return got

    def _compute(self, i: int, kind: str, op: Mapping, x: torch.Tensor, y) -> torch.Tensor:
        try:
            if kind == "add":
                return x + y
            if kind == "sub":
                return x - y
            if kind == "mul":
                return x * y
            if kind == "scale":
                return x * op["by"]
            if kind == "mean":
                return x.mean(dim=0, keepdim=True) if x.dim() else x
            if kind == "norm":
                return x.norm(dim=-1, keepdim=True) if x.dim() else x.abs()
            if kind == "clamp":
                return x.clamp(op.get("min"), op.get("max"))
            if kind in ("project", "project_out"):
                if x.dim() == 0 or y.dim() == 0 or x.shape[-1] != y.shape[-1]:
                    raise InputError(
                        f"{self.where(i)}: the direction's last axis {list(y.shape)} does not match the value's {list(x.shape)}"
                    )
                unit = y / y.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)  # 0 for a zero direction
                along = (x * unit).sum(dim=-1, keepdim=True) * unit
                return along if kind == "project" else x - along
        except RuntimeError:
            shapes = f"{list(x.shape)} and {list(y.shape) if isinstance(y, torch.Tensor) else 'a number'}"
            raise InputError(f"{self.where(i)}: shapes {shapes} do not match (broadcast)") from None
        raise AssertionError(kind)

    def _rows(self, op: Mapping, state: _State) -> torch.Tensor | None:
        """A read's value: its site's rows at its positions, from this pass and the passes before."""
        parts = state.reads.get(op["id"], [])
        if not parts:
            return None
        if not _position_axis(op["site"]):
            return parts[-1][1]  # (1, ...): the newest position's
        wanted = _resolve(self.positions.get(self.by_id[op["id"]]), state.n)
        firsts = [first for first, _ in parts]  # ascending: the passes in order
        taken = []
        for p in wanted:
            if (k := bisect.bisect_right(firsts, p) - 1) >= 0 and p - firsts[k] < len(parts[k][1]):
                taken.append(parts[k][1][p - firsts[k]])
        if not taken:
            return None
        return torch.stack(_padded(taken, spec(op["site"]).fill))  # (P, ...)

    def rows_of(self, i: int, start: int, n_rows: int, n: int) -> list[int]:
        """The rows of a pass (its first position ``start``, ``n`` positions so far) that write ``i`` acts at."""
        if not _position_axis(self.ops[i]["site"]):
            return [0]  # the newest position's value, the only one the site holds
        wanted = set(_resolve(self.positions.get(i), n))
        return [r for r in range(n_rows) if start + r in wanted]

    def keep_from(self, id: str, n: int) -> int:
        """The first position a read may still need in a later pass (``n``: the positions so far): rows
        before it are dropped, so reading the newest position costs the same at every step."""
        positions = self.positions.get(self.by_id[id])
        if positions is None:
            return 0
        if positions.listed is not None:
            absolute = [p for p in positions.listed if p >= 0]
            from_newest = [n + p for p in positions.listed if p < 0]  # a later pass's newest is later
            return max(0, min([*absolute, *from_newest]))
        start = positions.start or 0
        return start if start >= 0 else max(0, n + start)

    def write(self, i: int, current: torch.Tensor, state: _State, rows: list[int], device) -> torch.Tensor | None:
        """``current`` (the pass's rows first) with operation ``i``'s write put in at ``rows`` (the
        pass's rows its positions name), or None when its value has no row in this pass."""
        op = self.ops[i]
        value = self.value(op["value"], state, device)
        if value is None:
            return None
        wanted = _resolve(self.positions.get(i), state.n) if _position_axis(op["site"]) else [state.n - 1]
        target = _picked(op["site"], current[rows], op)  # (R, ...)
        shape = (len(wanted), *target.shape[1:])
        try:
            whole = value.expand(shape) if value.dim() <= len(shape) else None
        except RuntimeError:
            whole = None
        if whole is None:
            raise InputError(
                f"{self.where(i)}: its value has shape {list(value.shape)}; {op['site']} there is {list(shape)} "
                f"({len(wanted)} position{'' if len(wanted) == 1 else 's'})"
            )
        here = [wanted.index(state.start + r) for r in rows]
        new_rows = whole[here].to(current.dtype)
        if op["mode"] == "add":
            new_rows = (target.float() + whole[here]).to(current.dtype)
        out = current.clone()
        if "heads" not in op and "experts" not in op:
            out[rows] = new_rows
            return out
        axes = _axes(op["site"])
        picked = out[rows]  # (R, ...): the chosen heads or experts put in along their axis
        for key, letter in (("heads", "H"), ("experts", "E")):
            if key in op:
                dim = axes.index(letter)
                picked.index_copy_(dim, torch.tensor(op[key], device=current.device), new_rows)
        out[rows] = picked
        return out


def _padded(rows: list[torch.Tensor], fill: float) -> list[torch.Tensor]:
    """Rows of passes that saw fewer keys (an S or K axis), padded as the Tracer merges passes."""
    if len({tuple(r.shape) for r in rows}) == 1:
        return rows
    sizes = [max(r.shape[d] for r in rows) for d in range(rows[0].dim())]
    out = []
    for r in rows:
        pad = []
        for d in reversed(range(r.dim())):
            pad.extend((0, sizes[d] - r.shape[d]))
        out.append(torch.nn.functional.pad(r, pad, value=fill))
    return out


@dataclass(frozen=True)
class GraphRun(Intervention):
    """A graph carried out on the hook points: at each hook point, in each forward pass, the graph's
    reads of it keep its rows (as the model computed them so far: before this graph's writes there),
    then its writes there are evaluated and put in, and each save is evaluated once every read it
    uses ran in the pass. A write whose value needs a read the pass has not reached is an InputError."""

    graph: Graph = field(hash=False)
    _state: dict = field(default_factory=dict, hash=False, compare=False, repr=False)

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        program = Program(self.graph, args)
        state = _State()
        self._state.clear()
        self._state.update(program=program, state=state)
        by_site: dict[str, tuple[list[int], list[int]]] = {}  # site -> (its reads, its writes)
        for i, op in enumerate(program.ops):
            if op["op"] in ("read", "write"):
                by_site.setdefault(op["site"], ([], []))[op["op"] == "write"].append(i)
        saves = [i for i, op in enumerate(program.ops) if op["op"] == "save"]
        needs = {i: program.reads_of(i) for i in [*saves, *(i for _, w in by_site.values() for i in w)]}
        n_heads = args.n_heads

        def act(value: torch.Tensor, ctx: PassContext, name: str) -> torch.Tensor | None:
            batched = spec(name).legend.startswith("B")
            if batched and value.shape[0] != 1:
                raise InputError("a graph runs on one sequence (batch size 1)")
            if ctx.start != state.start:  # a new pass: a prefill, or a decode step
                # its positions so far (logits.last's rows are no positions: the pass has one at least)
                state.start, state.n = ctx.start, ctx.start + (ctx.n_rows if _position_axis(name) else 1)
                state.prune(program)
                state.values.clear()
                state.fired.clear()
                state.done.clear()
            if spec(name).rank_local and value.shape[2] != n_heads:
                raise InputError(f"{name}: a rank holds only its heads under tensor parallelism: a graph reads them whole")
            mine = value[0] if batched else value  # (T, ...) or, without a position axis, (...)
            rows_first = mine if _position_axis(name) else mine.unsqueeze(0)
            reads, writes = by_site[name]
            for i in reads:
                op = program.ops[i]
                picked = _picked(name, rows_first.detach(), op).to(torch.float32, copy=True)  # kept past this pass
                first = ctx.start if _position_axis(name) else state.n - 1
                state.reads.setdefault(op["id"], []).append((first, picked))
                state.fired.add(op["id"])
            new = rows_first
            for i in writes:
                if missing := needs[i] - state.fired:
                    site = program.ops[program.by_id[sorted(missing)[0]]]["site"]
                    raise InputError(f"{program.where(i)} at {name} uses the read of {site}, which the model computes later")
                rows = program.rows_of(i, ctx.start, ctx.n_rows, state.n)
                if rows and (got := program.write(i, new, state, rows, value.device)) is not None:
                    new = got
            for i in saves:
                if i not in state.done and needs[i] <= state.fired:
                    state.done.add(i)
                    if (got := program.value(program.ops[i]["value"], state, value.device)) is not None:
                        state.saved.setdefault(program.ops[i]["name"], []).append(got.detach().float().cpu())
            if new is rows_first:
                return None
            new = new if _position_axis(name) else new[0]
            return new.unsqueeze(0) if batched else new

        return {name: (lambda value, ctx, name=name: act(value, ctx, name)) for name in by_site}

    def recorded(self) -> dict[str, torch.Tensor]:
        state: _State | None = self._state.get("state")
        if state is None:
            return {}
        out = {}
        for name, parts in state.saved.items():
            parts = [p.reshape(1) if p.dim() == 0 else p for p in parts]
            if len({tuple(p.shape[1:]) for p in parts}) > 1:
                shapes = [list(p.shape) for p in parts][:3]
                raise InputError(f"graph save {name!r}: its value changes shape between passes ({shapes})")
            out[SAVED + name] = torch.cat(parts)
        return out

    def describe(self) -> str:
        return self.graph.describe()


def check_graph(graph: Graph, args: ModelArgs, n_prompt: int, generate: int = 0, prefill: int | None = None) -> None:
    """Everything a graph can be checked for before a run, on meta tensors (no model work): its sites,
    heads and experts in this model, its positions within the run, and every shape, in the prefill
    and in a decode step. InputError, one line, for the first thing wrong."""
    program = Program(graph, args)
    n_positions = n_prompt + generate
    sizes = [t.numel() for t in program.consts.values()]
    for op in program.ops:
        if "site" in op:
            legend = site_legend(args, op["site"])[0]
            sizes.append(math.prod(site_shape(args, op["site"], legend, n_positions)))
    program.max_elements = max([MIN_VALUE_LIMIT, *sizes])
    n_first = n_prompt if prefill is None else prefill
    for i, op in enumerate(program.ops):
        positions = program.positions.get(i)
        if positions is not None and positions.listed is not None:
            beyond = [p for p in positions.listed if p >= n_positions or p < -n_positions]
            if beyond:
                raise InputError(f"{program.where(i)}: position {beyond[0]} is outside the run's 0..{n_positions - 1}")
        if op["op"] == "write" and _position_axis(op["site"]) and not _resolve(positions, n_positions):
            raise InputError(f"{program.where(i)}: its positions name none of the run's 0..{n_positions - 1}")
    # the prefill, the first decode step and the last (the most positions so far), each after the
    # positions before it as one earlier pass: what a run would raise on shapes, raised before it
    passes = [(0, n_first)] + [(start, 1) for start in sorted({n_first, n_positions - 1}) if start >= n_first and start > 0]
    saved: dict[str, tuple[int, ...]] = {}
    for start, n_rows in passes:
        for name, shape in _dry_pass(program, start, n_rows).items():
            if saved.setdefault(name, shape) != shape:
                raise InputError(
                    f"graph save {name!r}: its value's rows are {list(saved[name])} in one pass, {list(shape)} in another"
                    " (a key axis grows at each decode step): save a value whose rows keep their shape"
                )


def _dry_pass(program: Program, start: int, n_rows: int) -> dict[str, tuple[int, ...]]:
    """One pass of the graph on meta tensors of the sites' shapes, after the positions before ``start``
    as one earlier pass; the saves' row shapes."""
    n = start + n_rows
    state = _State(start=start, n=n)
    meta = torch.device("meta")

    def rows(name: str, first: int, count: int) -> torch.Tensor:  # a pass's value, rows first, batch dropped
        shape = site_shape(program.args, name, site_legend(program.args, name)[0], first + count)
        return torch.empty((count, *shape[1:]) if _position_axis(name) else (1, *shape), device=meta)

    for op in program.ops:
        if op["op"] == "read":
            name = op["site"]
            parts = [(0, start), (start, n_rows)] if start and _position_axis(name) else [(start, n_rows)]
            for first, count in parts:
                where = first if _position_axis(name) else n - 1
                state.reads.setdefault(op["id"], []).append((where, _picked(name, rows(name, first, count), op)))
    out = {}
    for i, op in enumerate(program.ops):
        if op["op"] == "write":
            current = rows(op["site"], start, n_rows)
            if here := program.rows_of(i, start, len(current), n):
                program.write(i, current, state, here, meta)
        elif op["op"] == "save" and (value := program.value(op["value"], state, meta)) is not None:
            out[op["name"]] = tuple(value.shape[1:])
    return out


def mean_difference(a, b, site: str) -> torch.Tensor:
    """A direction from two runs (tracing.trace.Trace): ``site``'s mean over the positions of ``a``
    less its mean over ``b``'s, BOS left out (every prompt shares it): (D,) float32, a constant to steer by."""
    for trace in (a, b):
        if site not in trace or trace.n_tokens < 2:
            raise InputError(f"mean_difference: a trace lacks {site!r} (or holds one token only)")
    return (a[site][1:].float().mean(0) - b[site][1:].float().mean(0)).contiguous()


def graph_of(value: Graph | Mapping | None) -> Graph | None:
    """A request's graph from a Graph or its JSON form (a dict)."""
    if value is None or isinstance(value, Graph):
        return value
    if isinstance(value, Mapping):
        return Graph.from_dict(dict(value))
    raise InputError(f"graph: expected a tracing Graph or its JSON object, not {type(value).__name__}")


__all__ = ["Graph", "GraphRun", "Positions", "Value", "check_graph", "graph_of", "mean_difference"]
