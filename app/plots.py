"""The app's figures from a Trace, outside the app: plotly figures as the pages draw them, for a
notebook or a script (no Streamlit session needed).

    import tracing
    from app import plots

    trace = tracing.load("demo").run("It is a truth universally acknowledged", record="all", attribute=True)
    plots.plot(trace, "router_scores", block=1).show()
    plots.names()  # every figure this module draws
    plots.plot(tracing.load("demo").run("It is a truth", record="default,flow", attribute=True), "contribution_graph")
    plots.patching_map(sweep.table, "heads", sweep.summary)  # a patching sweep's heat map

Each figure is a topic's shaping (app/topics: numpy and pandas cut from the trace) and its
``*_figure`` function; ``plot`` raises ValueError naming the sites a trace lacks for one.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Hashable
from typing import Any

import pandas as pd
import plotly.graph_objects as go

from tracing.tables import BUILDERS
from tracing.trace import Trace

from .topics import attention, attribution, card_plots, experts, patching, predictions
from .topics.tokens import labels

__all__ = ["names", "patching_map", "plot"]


class _Held:
    """What the topics' figure functions read of a page's view: the trace, its config and a memo."""

    def __init__(self, trace: Trace, block: int):
        self.trace, self.block, self._memo = trace, block, {}

    @property
    def config(self):
        return self.trace.config

    @property
    def n_tokens(self) -> int:
        return self.trace.n_tokens

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def table(self, name: str):
        return self.memo(("table", name), lambda: BUILDERS[name](self.trace))


def _logit_lens(held: _Held, block: int) -> go.Figure | None:
    lens = predictions.logit_lens(held.trace)
    return None if lens is None else predictions.logit_lens_figure(lens, labels(held))


def _indexer_recall(held: _Held, block: int) -> go.Figure | None:
    got = attention.recall_grid(held.table("indexer_recall"), held.n_tokens)
    return None if got is None else attention.recall_figure(got[0], got[1], labels(held))


def _expert_load(held: _Held, block: int) -> go.Figure | None:
    got = experts.load_grid(held.table("expert_load"))
    return None if got is None else experts.expert_load_figure(got[0], got[1], got[2], held.n_tokens)


def _attribution_waterfall(held: _Held, block: int) -> go.Figure | None:
    info = attribution.attributed(held.trace)
    if info is None:
        return None
    what = f"the logit of {attribution.token_name(held.trace, info['target'])!r}"
    if info["contrast"] is not None:
        what += f" minus that of {attribution.token_name(held.trace, info['contrast'])!r}"
    return attribution.waterfall_figure(attribution.coarse_parts(held.trace), info["total"], html.escape(what))


def _attribution_grid(held: _Held, block: int) -> go.Figure | None:
    grid = attribution.block_grid(held.trace) if attribution.attributed(held.trace) else None
    return None if grid is None else attribution.grid_figure(*grid)


def _attribution_block(kind: str) -> Callable[[_Held, int], go.Figure | None]:
    def draw(held: _Held, block: int) -> go.Figure | None:
        parts = attribution.block_parts(held.trace, block) if attribution.attributed(held.trace) else None
        if parts is None:
            return None
        return attribution.heads_figure(parts, block) if kind == "heads" else attribution.ffn_figure(parts, block)

    return draw


def _contribution_graph(
    held: _Held, block: int, position: int | None = None, top: int = attribution.TOP_EDGES, threshold: float | None = None
) -> go.Figure | None:
    info = attribution.attributed(held.trace)
    if position is None:
        position = info["position"] if info is not None else held.n_tokens - 1
    if not 0 <= position < held.n_tokens:
        raise ValueError(f"position {position}: the trace has positions 0..{held.n_tokens - 1}")
    graph = attribution.flow_graph(held.trace, position, threshold, top)
    rule = attribution.edge_rule(top, threshold)
    return None if graph is None else attribution.flow_figure(graph, labels(held), position, rule)


# name -> (draw(held, block), the sites it needs: what an error names)
_FIGURES: dict[str, tuple[Callable[..., go.Figure | None], str]] = {
    **{name: (fn, "the card's sites (record 'all')") for name, fn in card_plots.PLOTS.items()},
    "logit_lens": (_logit_lens, "layers.{i}.logit_lens.*"),
    "indexer_recall": (_indexer_recall, "layers.{i}.attn.indexer.recall"),
    "expert_load": (_expert_load, "layers.{i}.ffn.gate.topk_indices"),
    "attribution_waterfall": (_attribution_waterfall, "attribution (attribute=True)"),
    "attribution_grid": (_attribution_grid, "attribution (attribute=True)"),
    "attribution_heads": (_attribution_block("heads"), "attribution (attribute=True)"),
    "attribution_ffn": (_attribution_block("ffn"), "attribution (attribute=True)"),
    "contribution_graph": (_contribution_graph, "layers.{i}.attn.flow (record 'default,flow')"),
}


def patching_map(table: pd.DataFrame, site: str, summary: dict) -> go.Figure:
    """A patching sweep's heat map of one ``site`` (resid_pre, attn_out, ffn_out, heads, experts) as the
    Patching page draws it, from the sweep's table and summary (``tracing.analyses.patching.sweep``'s
    Sweep, or ``patching --out DIR``'s patching.csv and summary.json)."""
    fig = patching.map_figure(table, site, summary)
    if fig is None:
        raise ValueError(f"the table has no row of site {site!r}: it holds {', '.join(sorted(set(table['site'])))}")
    return fig


def names() -> list[str]:
    """Every figure ``plot`` draws."""
    return sorted(_FIGURES)


def plot(trace: Trace, name: str, block: int = 0, **options: Any) -> go.Figure:
    """The figure ``name`` of ``trace`` (for a block's figure: ``block``), as the app draws it.
    ``options`` go to the figures that take them (``head=`` for attention_pattern; ``position=``,
    ``top=`` or ``threshold=`` for contribution_graph, default the attributed position and each
    stream's top 3 edges)."""
    if name not in _FIGURES:
        raise ValueError(f"no figure {name!r}: choose from {', '.join(names())}")
    if not 0 <= block < trace.config.n_layers:
        raise ValueError(f"block {block}: the trace's model has blocks 0..{trace.config.n_layers - 1}")
    draw, needs = _FIGURES[name]
    held = _Held(trace, block)
    figure = draw(held, block, **options) if options else draw(held, block)
    if figure is None:
        raise ValueError(f"figure {name!r} of block {block}: the trace lacks its sites ({needs})")
    return figure
