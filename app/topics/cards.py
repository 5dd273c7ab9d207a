"""Component cards: their content is data (``assets/cards/*.json``); this module reads it, resolves the
symbolic shapes for a config, and cuts the code excerpts out of the project's own source.

No Streamlit here: rendering lives in :mod:`app.ui.widgets`, the live plots in :mod:`app.topics.card_plots`. A card file holds::

    id, order, title, scope (model | all | dense | moe), summary, equations (LaTeX),
    inputs / params / outputs: [{symbol (LaTeX), dims ["B", "T", "D"], dtype?, what?}],
    facts: ["softmax scale {{softmax_scale:.5f}}", ...], explanation (Markdown),
    code: [{"ref": "module:Qualname", "lines"?: [substring, ...], "context"?: n}], plot, sites

Dimensions are symbols of ``dims.json`` or small expressions of them (``Dn+R``, ``H*Dv``), with an
optional label after a colon (``Dn+R:qk``). ``{{name}}`` in prose is filled from the config.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import operator
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from app.core.keys import Key
from model.config import ModelArgs

REPO = Path(__file__).resolve().parents[2]
CARDS_DIR = REPO / "assets" / "cards"
SCOPES = ("model", "all", "dense", "moe")


class CardError(ValueError):
    """A card file that does not follow the schema above."""


@dataclass(frozen=True)
class TensorSpec:
    symbol: str
    dims: tuple[str, ...]
    dtype: str = ""
    what: str = ""


@dataclass(frozen=True)
class Anchor:
    ref: str  # module:qualname
    lines: tuple[str, ...] = ()  # keep only lines containing one of these (all when empty)
    context: int = 0


@dataclass(frozen=True)
class Card:
    id: str
    order: int
    title: str
    scope: str
    summary: str
    equations: tuple[str, ...]
    inputs: tuple[TensorSpec, ...]
    params: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    code: tuple[Anchor, ...]
    explanation: str
    plot: str
    facts: tuple[str, ...] = ()
    sites: tuple[str, ...] = ()


@dataclass(frozen=True)
class Excerpt:
    """Source lines of one anchor: pieces of (first line number, text), file relative to the repo."""

    ref: str
    path: str
    start: int
    end: int
    pieces: tuple[tuple[int, str], ...] = field(default=())

    @property
    def title(self) -> str:
        return f"{self.path} {self.start}–{self.end}"

    def text(self) -> str:
        """The pieces joined by a comment naming the lines left out, as the seed pages do."""
        out: list[str] = []
        previous_end = None
        for first, chunk in self.pieces:
            if previous_end is not None and first > previous_end + 1:
                out.append(f"# … lines {previous_end + 1}–{first - 1} omitted …")
            out.append(chunk)
            previous_end = first + chunk.count("\n")
        return "\n".join(out)


# --- loading -------------------------------------------------------------------------------------------
def _specs(data: Any, where: str) -> tuple[TensorSpec, ...]:
    if not isinstance(data, list):
        raise CardError(f"{where}: expected a list of tensors")
    out = []
    for item in data:
        if not isinstance(item, dict) or "symbol" not in item or not isinstance(item.get("dims"), list):
            raise CardError(f"{where}: each tensor needs a symbol and a list of dims")
        out.append(TensorSpec(item["symbol"], tuple(item["dims"]), item.get("dtype", ""), item.get("what", "")))
    return tuple(out)


def parse_card(data: dict[str, Any], where: str) -> Card:
    required = ("id", "order", "title", "scope", "summary", "equations", "code", "explanation", "plot")
    missing = [key for key in required if key not in data]
    if missing:
        raise CardError(f"{where}: missing {', '.join(missing)}")
    if data["scope"] not in SCOPES:
        raise CardError(f"{where}: scope {data['scope']!r} is not one of {SCOPES}")
    if not data["equations"] or not all(isinstance(e, str) for e in data["equations"]):
        raise CardError(f"{where}: equations must be a non-empty list of LaTeX strings")
    anchors = []
    for item in data["code"]:
        if not isinstance(item, dict) or ":" not in item.get("ref", ""):
            raise CardError(f"{where}: code anchors look like {{'ref': 'model.norm:RMSNorm.forward'}}")
        anchors.append(Anchor(item["ref"], tuple(item.get("lines", ())), int(item.get("context", 0))))
    return Card(
        id=data["id"],
        order=int(data["order"]),
        title=data["title"],
        scope=data["scope"],
        summary=data["summary"],
        equations=tuple(data["equations"]),
        inputs=_specs(data.get("inputs", []), f"{where} inputs"),
        params=_specs(data.get("params", []), f"{where} params"),
        outputs=_specs(data.get("outputs", []), f"{where} outputs"),
        code=tuple(anchors),
        explanation=data["explanation"],
        plot=data["plot"],
        facts=tuple(data.get("facts", ())),
        sites=tuple(data.get("sites", ())),
    )


@lru_cache(maxsize=1)
def load_cards(directory: Path = CARDS_DIR) -> dict[str, Card]:
    """Every card, in the order of the forward pass."""
    cards = []
    for path in sorted(directory.glob("*.json")):
        if path.name == "dims.json":
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CardError(f"{path.name}: not readable JSON ({exc})") from None
        cards.append(parse_card(data, path.name))
    return {card.id: card for card in sorted(cards, key=lambda c: c.order)}


@lru_cache(maxsize=1)
def load_dims(directory: Path = CARDS_DIR) -> dict[str, dict[str, Any]]:
    return json.loads((directory / "dims.json").read_text(encoding="utf-8"))


# --- shapes -----------------------------------------------------------------------------------------------
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv}


def _evaluate(expr: str, names: dict[str, int | None]) -> int | None:
    """A small integer expression of dimension names (+ - * // min); None when a name is run-dependent."""

    def walk(node: ast.AST) -> int | None:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise CardError(f"unknown dimension {node.id!r} in {expr!r}")
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            return None if left is None or right is None else _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "min":
            values = [walk(arg) for arg in node.args]
            return None if any(v is None for v in values) else min(values)  # type: ignore[type-var]
        raise CardError(f"unsupported dimension expression {expr!r}")

    return walk(ast.parse(expr, mode="eval"))


def dim_sizes(args: ModelArgs, n_tokens: int | None = None) -> dict[str, int | None]:
    """Size of every dimension symbol: config dims always, run dims (B, T, S, N) when n_tokens is given."""
    fields = {k: v for k, v in vars(args).items() if isinstance(v, int) and not isinstance(v, bool)}
    sizes: dict[str, int | None] = {}
    for symbol, spec in load_dims().items():
        if "run" in spec:
            sizes[symbol] = None if n_tokens is None else _evaluate(spec["run"], {**fields, "tokens": n_tokens})
        else:
            sizes[symbol] = _evaluate(spec["config"], fields)
    return sizes


def _split(dim: str) -> tuple[str, str | None]:
    expr, _, label = dim.partition(":")
    return expr.strip(), (label.strip() or None)


def shape_text(dims: tuple[str, ...], args: ModelArgs) -> str:
    """``[B batch, T positions, 7168 d]``: run dims symbolic, config dims resolved, each named."""
    table = load_dims()
    sizes = dim_sizes(args)
    config = {k: v for k, v in vars(args).items() if k != "extra"}
    parts = []
    for dim in dims:
        expr, label = _split(dim)
        if expr in table:
            name = label or fill(table[expr]["name"], config)
            value = sizes[expr]
            parts.append(f"{expr} {name}" if value is None else f"{value} {name}")
        else:
            value = _evaluate(expr, sizes)
            parts.append(f"{expr} {label or ''}".strip() if value is None else f"{value} {label or expr}")
    return "[" + ", ".join(parts) + "]"


def shape_here(dims: tuple[str, ...], args: ModelArgs, n_tokens: int) -> list[int]:
    """The same shape for this run: every dimension a number."""
    sizes = dim_sizes(args, n_tokens)
    return [int(_evaluate(_split(dim)[0], sizes)) for dim in dims]  # type: ignore[arg-type]


# --- prose ------------------------------------------------------------------------------------------------
_FIELD = re.compile(r"\{\{(\w+)(?::([^}]*))?\}\}")


def _ranges(blocks: list[int]) -> str:
    if not blocks:
        return "none"
    return f"block {blocks[0]}" if len(blocks) == 1 else f"blocks {blocks[0]}–{blocks[-1]}"


def facts_for(args: ModelArgs, block: int | None = None, n_tokens: int | None = None) -> dict[str, Any]:
    """Values prose may name: every config field, derived quantities, and the chosen block."""
    values: dict[str, Any] = {k: v for k, v in vars(args).items() if k != "extra"}
    if args.use_yarn:
        mscale = 0.1 * args.mscale * math.log(args.rope_factor) + 1.0
        yarn = (
            f"on: max_seq_len {args.max_seq_len} > original_seq_len {args.original_seq_len}, factor {args.rope_factor:g}, "
            f"softmax scale × mscale² = {mscale * mscale:.4f}"
        )
    else:
        yarn = f"off: max_seq_len {args.max_seq_len} ≤ original_seq_len {args.original_seq_len}, plain RoPE"
    values.update(
        qk_head_dim=args.qk_head_dim,
        softmax_scale=args.softmax_scale,
        yarn=yarn,
        experts_per_group=args.experts_per_group,
        n_moe_layers=args.n_moe_layers,
        gate_bias="yes" if args.has_gate_bias else "no",
        dense_blocks=_ranges(list(range(min(args.n_dense_layers, args.n_layers)))),
        moe_blocks=_ranges(list(range(args.n_dense_layers, args.n_layers))),
        shared_width=args.n_shared_experts * args.moe_inter_dim,
    )
    if block is not None:
        values.update(block=block, block_kind="an MoE block" if args.is_moe(block) else "a dense block")
    if n_tokens is not None:
        values.update(T=n_tokens, K_run=min(args.index_topk, n_tokens))
    return values


def fill(text: str, values: dict[str, Any]) -> str:
    """Replace ``{{name}}`` and ``{{name:fmt}}``; unknown names stay visible rather than failing."""

    def one(match: re.Match) -> str:
        name, fmt = match.group(1), match.group(2)
        if name not in values:
            return match.group(0)
        value = values[name]
        try:
            return format(value, fmt) if fmt else (f"{value:,}" if isinstance(value, int) and value >= 10000 else str(value))
        except (TypeError, ValueError):
            return str(value)

    return _FIELD.sub(one, text)


# --- code excerpts ----------------------------------------------------------------------------------------
def _resolve(ref: str) -> Any:
    module_name, _, qualname = ref.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return inspect.unwrap(obj)


@lru_cache(maxsize=128)
def excerpt(anchor: Anchor) -> Excerpt:
    """The anchor's source, read now from the file that defines it (so it never drifts)."""
    try:
        obj = _resolve(anchor.ref)
        lines, start = inspect.getsourcelines(obj)
        source = inspect.getsourcefile(obj) or "?"
    except (ImportError, AttributeError, OSError, TypeError) as exc:
        raise CardError(f"code anchor {anchor.ref!r}: {exc}") from None
    try:
        path = str(Path(source).resolve().relative_to(REPO))
    except ValueError:
        path = source
    lines = [line.rstrip("\n") for line in lines]
    end = start + len(lines) - 1
    if not anchor.lines:
        return Excerpt(anchor.ref, path, start, end, ((start, _dedent(lines)),))
    keep = sorted(
        {
            j
            for i, line in enumerate(lines)
            if any(s in line for s in anchor.lines)
            for j in range(max(i - anchor.context, 0), min(i + anchor.context + 1, len(lines)))
        }
    )
    if not keep:
        raise CardError(f"code anchor {anchor.ref!r}: no line contains any of {list(anchor.lines)}")
    pieces: list[tuple[int, list[str]]] = []
    for i in keep:
        if pieces and pieces[-1][0] + len(pieces[-1][1]) == start + i:
            pieces[-1][1].append(lines[i])
        else:
            pieces.append((start + i, [lines[i]]))
    indent = min(len(line) - len(line.lstrip()) for _, chunk in pieces for line in chunk if line.strip())
    return Excerpt(
        anchor.ref,
        path,
        pieces[0][0],
        pieces[-1][0] + len(pieces[-1][1]) - 1,
        tuple((first, "\n".join(line[indent:] for line in chunk)) for first, chunk in pieces),
    )


def _dedent(lines: list[str]) -> str:
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


# the Block anatomy page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("anatomy_component", "Block anatomy: the card shown", kept=True),
    Key("anatomy_prev", "Block anatomy: the previous card button"),
    Key("anatomy_next", "Block anatomy: the next card button"),
    Key("anatomy_", "Block anatomy: a card's own widgets (the card id)", family=True),
)
