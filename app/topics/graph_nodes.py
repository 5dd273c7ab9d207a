"""The contribution graph's nodes as the reader clicks them, as llm-transparency-tool's graph answers a
click: a diamond is one block's heads into one position, a square one block's FFN at one position
(app.topics.attribution.flow_figure gives each its ``[kind, block, position]``). For the node: each
head or expert with what the graph says it brought (its share of the receiving stream), and at the
attributed position its direct logit attribution (a head's part, its sources and what its dropped
keys would have added; an expert's part and its logit lens). The page lays these out with the
expert's atlas card; nothing here draws."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from tracing.trace import Trace

from .attribution import attributed, token_name

KINDS = ("attention", "ffn")
SOURCES = 5  # a head's largest sources listed


@dataclass(frozen=True)
class Node:
    kind: str  # "attention": block's heads into position; "ffn": block's experts at position
    block: int
    position: int

    def title(self) -> str:
        what = "heads into" if self.kind == "attention" else "FFN at"
        return f"Block {self.block}'s {what} position {self.position}"


def picked(points: Iterable[Mapping[str, Any]], trace: Trace) -> Node | None:
    """The node a chart selection names (its first point that is one), or None: the points of the
    edges carry no node, and a node is checked against the trace (a selection is the browser's)."""
    for point in points:
        data = point.get("customdata")
        if not isinstance(data, (list, tuple)) or len(data) != 3 or data[0] not in KINDS:
            continue
        try:
            node = Node(str(data[0]), int(data[1]), int(data[2]))
        except (TypeError, ValueError):
            continue
        if 0 <= node.block < trace.config.n_layers and 0 <= node.position < trace.n_tokens:
            return node
    return None


def at_attributed(trace: Trace, node: Node) -> bool:
    """Whether the node's position is the one the trace attributes (parts, sources and lens are there)."""
    info = attributed(trace)
    return info is not None and info["position"] == node.position


def heads(trace: Trace, node: Node) -> pd.DataFrame:
    """Per head of the node's block: its direct part of the attributed logit, its largest sources
    (key position, token, part) and what the keys the indexer dropped would have added; NaN and empty
    away from the attributed position. Largest |part| first."""
    n_heads = trace.config.n_heads
    part, dropped = np.full(n_heads, np.nan), np.full(n_heads, np.nan)
    read = [""] * n_heads
    if at_attributed(trace, node) and (values := trace.site(node.block, "attn.attribution")) is not None:
        part = values.double().numpy()
        if (lost := trace.site(node.block, "attn.attribution_dropped")) is not None:
            dropped = lost.double().numpy()
        if (src := trace.site(node.block, "attn.attribution_src")) is not None:  # (H, S)
            src = src.double().numpy()
            for h in range(n_heads):
                order = [s for s in np.argsort(-np.abs(src[h]), kind="stable")[:SOURCES] if src[h, s] != 0]
                read[h] = " · ".join(f"{s} {token_name(trace, trace.token_ids[s])!r} {src[h, s]:+.3f}" for s in order)
    frame = pd.DataFrame({"head": np.arange(n_heads), "part": part, "sources": read, "dropped_keys": dropped})
    return frame.reindex(frame["part"].abs().sort_values(ascending=False, na_position="last").index).reset_index(drop=True)


def keys(trace: Trace, node: Node) -> pd.DataFrame:
    """What the node's block brought into its position through the attention, all heads together
    (``attn.flow``): each key position with a share above 0, largest first, and the stream's own share."""
    flow, kept = trace.site(node.block, "attn.flow"), trace.site(node.block, "attn.flow_resid")
    if flow is None or kept is None:
        return pd.DataFrame(columns=["source", "token", "share"])
    shares = flow[node.position].double().numpy()
    order = [int(s) for s in np.argsort(-shares, kind="stable") if shares[s] > 0]
    rows = [("itself (residual)", "", float(kept[node.position]))]
    rows += [(str(s), token_name(trace, trace.token_ids[s]), float(shares[s])) for s in order]
    return pd.DataFrame(rows, columns=["source", "token", "share"])


def experts(trace: Trace, node: Node) -> pd.DataFrame:
    """Per expert that wrote into the node's position (share above 0 in ``ffn.flow``; -1: the shared
    expert or a dense block's MLP): its share of the stream after the FFN and, at the attributed
    position, its direct part of the logit and the tokens its weighted output promotes and suppresses
    most. Largest share first."""
    flow = trace.site(node.block, "ffn.flow")
    if flow is None:
        return pd.DataFrame(columns=["expert", "label", "share", "part", "promotes", "suppresses"])
    shares = flow[node.position].double().numpy()  # (E + 1,) or (1,)
    here = at_attributed(trace, node)
    parts = trace.site(node.block, "ffn.attribution") if here else None
    lens = trace.site(node.block, "ffn.expert_lens.ids") if here else None
    rows = []
    for j in np.flatnonzero(shares > 0):
        routed = len(shares) > 1 and j < len(shares) - 1
        label = f"expert {j}" if routed else ("shared expert" if len(shares) > 1 else "MLP")
        words = ["", ""]
        if routed and lens is not None:
            words = [" ".join(token_name(trace, i) for i in lens[j, d].tolist() if i >= 0) for d in (0, 1)]
        part = float(parts[j]) if parts is not None else float("nan")
        rows.append((int(j) if routed else -1, label, float(shares[j]), part, *words))
    frame = pd.DataFrame(rows, columns=["expert", "label", "share", "part", "promotes", "suppresses"])
    return frame.sort_values("share", ascending=False, ignore_index=True)
