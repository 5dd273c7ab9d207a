"""The Attribution page's runs as plain functions over an AppModel: the request its pickers make, the
attributed trace (with the contribution graph on request), the causal check that removes the largest
parts one at a time; and what the pickers hold when a new trace arrives. The page lays these out;
nothing here draws."""

from __future__ import annotations

from collections.abc import MutableMapping

import pandas as pd

from app.core.keys import POSITION, TOKEN, Key, integer, number, one_of
from app.core.models import AppModel
from app.core.traces import Entry, TraceKey, token_of, trace_prompt
from tracing.analyses.attribution import AttributionRequest
from tracing.analyses.causal import causal_check
from tracing.runner import TraceRequest
from tracing.trace import Trace

from . import attribution as topic
from .interventions import strongest_block

NONE = -1  # the contrast picker's "none" (a selectbox shows None as no choice at all)


def fit_pickers(state: MutableMapping, plain: TraceKey, n_tokens: int) -> None:
    """A new trace resets the pickers to the last position's top prediction, no contrast; a session's
    first trace (a link's position and target) keeps them where they fit."""
    if state.get("attr_picked_for") not in (None, plain) or state.get("attr_position") not in range(n_tokens):
        state["attr_position"] = n_tokens - 1
        state["attr_target"] = state["attr_contrast"] = None
    state["attr_picked_for"] = plain


def request_of(
    om: AppModel | None, position: int, target: int | None, contrast: int | None, typed: str = "", typed_contrast: str = ""
) -> AttributionRequest:
    """What the pickers ask: a typed token (its text or id, any of the vocabulary) over the one picked;
    :data:`NONE` for no contrast. InputError when a typed token is not one token of ``om``'s."""
    if typed.strip() and om is not None:
        target = token_of(om, "Target", typed)
    if typed_contrast.strip() and om is not None:
        contrast = token_of(om, "Contrast", typed_contrast)
    return AttributionRequest(position, target, None if contrast == NONE else contrast)


def attributed(om: AppModel, plain: TraceKey, request: AttributionRequest, flow: bool = False) -> Entry:
    """The plain trace's prompt run again with ``request``'s attribution (and the contribution graph's
    sites when ``flow``), from the store when it has the run."""
    record = ("default", "flow") if flow else ("default",)
    return trace_prompt(
        om,
        plain.prompt,
        variant=topic.variant(request, flow),
        attribution=request,
        record=record,
        generation=plain.generation,
        chat=plain.chat,
    )


def causal(om: AppModel, plain: TraceKey, entry: Entry, n: int) -> pd.DataFrame:
    """The causal check of ``entry``'s attribution (tracing.analyses.causal): each of the ``n`` largest heads
    and routed experts removed at the attributed position only, the logit measured again; made once."""
    info = topic.attributed(entry.trace)
    request = TraceRequest(
        prompt=plain.prompt, attribute=True, position=info["position"], target=info["target"], contrast=info["contrast"]
    )

    def again(changed: TraceRequest) -> Trace:
        attribution = AttributionRequest(changed.position, changed.target, changed.contrast)
        return trace_prompt(
            om,
            plain.prompt,
            variant=topic.variant(attribution, False),
            attribution=attribution,
            interventions=changed.interventions,
            generation=plain.generation,
            chat=plain.chat,
        ).trace

    return entry.memo(("attr_causal", n), lambda: causal_check(again, request, n, entry.trace))


def fit_block(state: MutableMapping, entry: Entry, block: int) -> None:
    """The block whose parts are shown opens on the block of the largest head or expert part (where the
    answer is), once per attributed trace; then it is the reader's choice."""
    n = entry.trace.config.n_layers
    if state.get("attr_block_for") != entry.key or state.get("attr_block") not in range(n):
        state["attr_block_for"] = entry.key
        strongest = strongest_block(entry.trace)
        state["attr_block"] = strongest if strongest is not None else min(block, n - 1)


# the Attribution page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("attr_position", "Attribution: the attributed position", kept=True, link=POSITION),
    Key("attr_target", "Attribution: the target token", kept=True, link=TOKEN),
    Key("attr_contrast", "Attribution: the contrast token", kept=True, link=TOKEN),
    Key("attr_target_text", "Attribution: a target typed as text or id (any token)", kept=True),
    Key("attr_contrast_text", "Attribution: a contrast typed as text or id (any token)", kept=True),
    Key("attr_threshold", "Attribution: the contribution graph's edge threshold", kept=True, link=number(0.01, 0.5)),
    Key("attr_flow_run", "Attribution: the contribution graph's button"),
    Key("attr_flow_for", "Attribution: the plain trace's key the contribution graph was asked for"),
    Key("attr_picked_for", "Attribution: the plain trace's key the pickers were set for"),
    Key("attr_remove_", "Attribution: the one-click removal of a part (its key)", family=True),
    Key("attr_block", "Attribution: the block whose parts are shown", kept=True),
    Key("attr_block_for", "Attribution: the attributed trace's key the block was set for (its strongest block)"),
    Key("attr_causal_n", "Attribution: how many parts the causal check removes", kept=True),
    Key("attr_causal_run", "Attribution: the causal check's button"),
    Key("attr_causal_for", "Attribution: (the attributed trace's key, n) the causal check was asked for"),
    Key("attr_causal_csv", "Attribution: the causal check's CSV download"),
    Key("attr_csv", "Attribution: the parts' CSV download"),
    Key(
        "attr_edges",
        "Attribution: the contribution graph's edges, each stream's top k or above a share",
        kept=True,
        link=one_of("top k per stream", "above a share"),
    ),
    Key("attr_top", "Attribution: the contribution graph's k edges per stream", kept=True, link=integer(1, 20)),
    Key("attr_flow", "Attribution: the contribution graph (its selection: the node clicked)"),
    Key("attr_node", "Attribution: the contribution graph's node last clicked (graph_nodes.Node)"),
    Key("attr_node_pick", "Attribution: the head or expert of the clicked node whose detail is shown"),
    Key("attr_node_at", "Attribution: the button that attributes at the clicked node's position"),
)
