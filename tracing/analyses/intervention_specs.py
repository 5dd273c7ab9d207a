"""The interventions a request asks for, read from plain values (the command line's flags, the
app's widgets, a server request's JSON) and checked before anything runs: every malformed value is
an InputError naming the flag. What each intervention does to the model is
tracing.analyses.interventions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import InputError
from .interventions import (
    AblateExperts,
    AblateHeads,
    IndexTopK,
    Intervention,
    NoActFP8,
    NoGateBias,
    Positions,
    ZeroExperts,
)


def from_spec(request: Mapping[str, Any]) -> list[Intervention]:
    """The interventions a spec of plain values asks for, in the order they apply: the command line
    makes one from its flags, the app from its widgets (and keeps it, to run it again).

    * ``ablate``: ``"LAYER:EXPERT[@POSITIONS],..."`` or ``{block: [experts]}``; empty or absent: none
    * ``no_bias``: ``None``, ``"all"`` or ``[blocks]``
    * ``attention``: ``None`` (the model's index_topk), ``"dense"`` or another index_topk
    * ``no_act_fp8``: true for FP8 products without the activations' rounding
    * ``zero_experts``, ``ablate_heads``: as ``ablate`` (``"LAYER:ID[@POSITIONS],..."`` or ``{block: [ids]}``)
    * ``at``: ``"P"``, ``"A:B"``: the positions where the ``{block: [ids]}`` forms act (default: all)
    * ``features``: ``"SITE:FEATURE=0"``, ``"SITE:FEATURE*SCALE"`` or ``"SITE:FEATURE+AMOUNT"``, each
      ``[@POSITIONS]``, comma-separated: a feature of the run's dictionary of SITE zeroed, scaled, or
      its decoder direction added (tracing.dictionary.features.FeatureEdit)

    POSITIONS: ``P``, ``A:B`` (A..B-1), ``A:`` or ``:B``. Each intervention checks its values against
    the model when it runs.
    """
    out: list[Intervention] = []
    no_bias = request.get("no_bias")  # first: the removals below mask the scores it routes by
    if no_bias is not None:
        if no_bias != "all" and not (isinstance(no_bias, list | tuple) and all(_is_int(b) for b in no_bias)):
            raise InputError(f'no_bias: expected "all" or a list of block numbers, not {_shown(no_bias)}')
        out.append(NoGateBias(None if no_bias == "all" else tuple(no_bias)))
    at = request.get("at")
    at = parse_positions("at", str(at)) if at not in (None, "", "all") else None
    for key, kind, what in (
        ("ablate", AblateExperts, "EXPERT"),
        ("zero_experts", ZeroExperts, "EXPERT"),
        ("ablate_heads", AblateHeads, "HEAD"),
    ):
        value = request.get(key)  # "LAYER:ID[@P],..." (the flag's text) or {block: [ids]}
        flag = "--ablate-experts" if key == "ablate" else "--" + key.replace("_", "-")
        if isinstance(value, str) and value:
            out.extend(kind(pairs, positions) for positions, pairs in _placed_pairs(flag, what, value).items())
        elif value:
            out.append(kind(_block_ids(flag, value), at))
    attention = request.get("attention")
    if attention == "dense":
        out.append(IndexTopK.dense())
    elif attention is not None:
        if not _is_int(attention) or attention < 1:
            raise InputError(f'attention: expected "dense" or an index_topk (a positive integer), not {_shown(attention)}')
        out.append(IndexTopK(attention))
    features = request.get("features")  # "SITE:FEATURE=0[@P],..." (tracing.dictionary.features)
    if features:
        if not isinstance(features, str):
            raise InputError(f"features: expected SITE:FEATURE=0|*SCALE|+AMOUNT text, not {_shown(features)}")
        from ..dictionary.features import parse_edits

        out.extend(parse_edits(features, parse_positions))
    no_act_fp8 = request.get("no_act_fp8")
    if not isinstance(no_act_fp8, bool | None):
        raise InputError(f"no_act_fp8: expected true or false, not {type(no_act_fp8).__name__}")
    if no_act_fp8:
        out.append(NoActFP8())
    return out


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value of a spec as an error line shows it: its type, and its text cut short."""
    text = repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


def parse_positions(flag: str, text: str) -> Positions:
    """``P`` (one position), ``A:B`` (A..B-1), ``A:`` (A to the end) or ``:B``: ASCII digits only."""
    first, sep, stop = text.strip().partition(":")
    if not sep:
        stop = str(int(first) + 1) if _is_number(first) else "?"
    if not (_is_number(first) or (sep and not first)) or not (_is_number(stop) or (sep and not stop)):
        raise InputError(f"{flag} @{text}: expected a position P or a range A:B (A:, :B), e.g. @5 or @5:9")
    a, b = int(first or 0), (int(stop) if stop else None)
    if b is not None and b <= a:
        raise InputError(f"{flag} @{text}: the range {a}:{b} holds no position")
    return a, b


def _placed_pairs(flag: str, what: str, text: str) -> dict[Positions | None, dict[int, tuple[int, ...]]]:
    """``LAYER:ID[@POSITIONS],...`` grouped by their positions (None: every position), each as
    block -> sorted distinct ids (experts or heads)."""
    chosen: dict[Positions | None, dict[int, list[int]]] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        pair, at, where = item.partition("@")
        layer, sep, index = pair.partition(":")
        if not sep or not _is_number(layer.strip()) or not _is_number(index.strip()):
            raise InputError(f"{flag} {item!r}: expected LAYER:{what}[@POSITIONS], e.g. 3:17 or 3:17@5")
        positions = parse_positions(flag, where) if at else None
        chosen.setdefault(positions, {}).setdefault(int(layer), []).append(int(index))
    if not chosen:
        raise InputError(f"{flag}: no LAYER:{what} given")
    return {at: {layer: tuple(sorted(set(ids))) for layer, ids in pairs.items()} for at, pairs in chosen.items()}


def _block_ids(flag: str, value: Any) -> dict[int, tuple[int, ...]]:
    """``{block: [ids]}`` (JSON may have made the blocks strings) with every number an integer."""
    if not isinstance(value, Mapping):
        raise InputError(f"{flag}: expected LAYER:ID text or {{block: [ids]}}, not {type(value).__name__}")
    out = {}
    for block, ids in value.items():
        block = int(block) if isinstance(block, str) and _is_number(block) else block
        if not isinstance(ids, list | tuple) or not all(_is_int(i) for i in (block, *ids)):
            raise InputError(f"{flag}: blocks and ids must be integers")
        out[block] = tuple(sorted(set(ids)))
    return out


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 18


def check_positions(interventions: Sequence[Intervention], n_positions: int) -> None:
    """InputError for an intervention placed only at positions the run never reaches (``n_positions``:
    the prompt's and the generated tokens'): it would change nothing and say nothing."""
    for intervention in interventions:
        positions = getattr(intervention, "positions", None)
        if positions is not None and positions[0] >= n_positions:
            raise InputError(
                f"nothing to change: the run's last position is {n_positions - 1} (the prompt's tokens and"
                f" --generate's), and {intervention.describe().strip()}"
            )
