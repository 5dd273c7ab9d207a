"""One browser session: it remembers only small values, its widget choices and the key of the trace
it shows (enough to make that trace again should the store have dropped it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import streamlit as st

from model.config import ModelArgs
from tracing.trace import Trace

from . import settings
from .errors import BAD_INPUT
from .models import AppModel, open_model, open_server
from .traces import Entry, store

SOURCES = ("demo", "dir", "server", "upload")
TABBED_PAGES = ("model_map", "residual", "attention", "router", "generation")
CARDED_PAGES = ("residual", "attention", "router", "generation", "attribution")
_UNSET = object()


@dataclass(frozen=True)
class Key:
    """One session-state key: what it holds, its value when a session starts (if any), and whether
    it is a widget value carried across pages (Streamlit forgets a widget's value while the widget
    is not drawn: on another page, under another source). A family is a prefix: the key is it plus
    an id (a block, a card, a table)."""

    name: str
    what: str
    default: Any = _UNSET
    kept: bool = False
    family: bool = False


# Every key the app keeps, in one place: tests/app/test_session.py fails on a key the app uses and
# this table lacks.
SCHEMA: tuple[Key, ...] = (
    # the sidebar: source, model, prompt, run settings
    Key("source", "the model source: demo, dir (a checkpoint directory), server (a model server) or upload", _UNSET),
    Key("ckpt_dir", "the checkpoint directory typed", "", kept=True),
    Key("server_url", "the model server's URL (default ANATOMY_SERVER)", _UNSET, kept=True),
    Key("upload", "the uploaded trace file (the uploader's value)"),
    Key("dtype", "the activation dtype, bfloat16 or float32", "bfloat16", kept=True),
    Key("prompt", "the prompt", settings.DEFAULT_PROMPT, kept=True),
    Key("run", "the Trace button"),
    Key("chat", "the prompt framed as a chat turn", False, kept=True),
    Key("chat_thinking", "... with the answer starting in thinking mode", False, kept=True),
    Key("gen_tokens", "new tokens written after the prompt (0: trace the prompt alone)", 0, kept=True),
    Key("gen_mode", "greedy or sampled", "greedy", kept=True),
    Key("gen_temperature", "the sampling temperature", 0.8, kept=True),
    Key("gen_top_p", "the sampling top-p", 0.95, kept=True),
    Key("gen_seed", "the sampling seed; None: a new draw each time", None, kept=True),
    Key("block", "the block the pages show", 0, kept=True),
    Key("trace_key", "the TraceKey of the trace this session shows", None),
    Key("links_loaded", "the session read its URL's view (app.core.links), on its first run"),
    Key("upload_names", "the names this session gave the trace files it opened, by content digest", {}),
    # pages
    Key("map_block", "Model map: the block whose parameters are listed"),
    Key("anatomy_component", "Block anatomy: the card shown", kept=True),
    Key("anatomy_prev", "Block anatomy: the previous card button"),
    Key("anatomy_next", "Block anatomy: the next card button"),
    Key("anatomy_", "Block anatomy: a card's own widgets (the card id)", family=True),
    Key("query", "Attention: the query position", kept=True),
    Key("attention_head", "Attention: the head", kept=True),
    Key("router_biased", "Router: scores with the correction bias", kept=True),
    Key("gen_step", "Generation: the step shown", kept=True),
    Key("attr_position", "Attribution: the attributed position", kept=True),
    Key("attr_target", "Attribution: the target token", kept=True),
    Key("attr_contrast", "Attribution: the contrast token", kept=True),
    Key("attr_target_text", "Attribution: a target typed as text or id (any token)", kept=True),
    Key("attr_contrast_text", "Attribution: a contrast typed as text or id (any token)", kept=True),
    Key("attr_threshold", "Attribution: the contribution graph's edge threshold", kept=True),
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
    Key("patch_clean", "Patching: the clean prompt", kept=True),
    Key("patch_corrupt", "Patching: the corrupt prompt", kept=True),
    Key("patch_sites", "Patching: the sites swept", kept=True),
    Key("patch_positions", "Patching: the positions swept (all, last, A:B)", kept=True),
    Key("patch_target", "Patching: the target token (text or id; empty: the clean top)", kept=True),
    Key("patch_contrast", "Patching: the contrast token (text or id; empty: the corrupt top)", kept=True),
    Key("patch_run", "Patching: the Run button"),
    Key("patch_result", "Patching: the last sweep, {asked, table, summary}"),
    Key("patch_csv", "Patching: the table's CSV download"),
    Key("patch_cell", "Patching: the cell whose patched run is compared with the corrupt run"),
    Key("patch_fig_", "Patching: a site's heat map (the site)", family=True),
    Key("iv_result", "Interventions: the last run, {base: the baseline's key, spec: what was run}"),
    Key("iv_arriving", "Interventions: a removal another page asked for, run on arrival"),
    Key("iv_run", "Interventions: the Run button"),
    Key("iv_clear", "Interventions: the Clear button"),
    Key("iv_only_changed", "Interventions: show only what changed", kept=True),
    Key("iv_no_bias", "Interventions: route without the correction bias", kept=True),
    Key("iv_no_bias_blocks", "Interventions: ... in these blocks", kept=True),
    Key("iv_attention", "Interventions: the attention (sparse, dense, another top-k)", kept=True),
    Key("iv_topk", "Interventions: the other index_topk", kept=True),
    Key("iv_no_act_fp8", "Interventions: FP8 products without the activations' rounding", False, kept=True),
    Key("iv_at", "Interventions: the positions the removals act at (P, A:B; empty: every position)", kept=True),
    Key("iv_load_block", "Interventions: the block whose expert load is shown"),
    Key("iv_add_busiest_", "Interventions: add the busiest experts (per kind)", family=True),
    Key("iv_experts_", "Interventions: experts ablated in a block", family=True),
    Key("iv_block", "Interventions: the block whose experts are being ablated"),
    Key("iv_ablate_text", "Interventions: experts to ablate, typed as LAYER:EXPERT,..."),
    Key("iv_zeroed_", "Interventions: experts zeroed in a block", family=True),
    Key("iv_zero_block", "Interventions: the block whose experts are being zeroed"),
    Key("iv_zero_text", "Interventions: experts to zero, typed"),
    Key("iv_heads_", "Interventions: heads ablated in a block", family=True),
    Key("iv_head_block", "Interventions: the block whose heads are being ablated"),
    Key("iv_head_text", "Interventions: heads to ablate, typed"),
    Key("iv_show", "Interventions: show the intervened trace in the other pages"),
    Key("iv_show_base", "Interventions: show the baseline again"),
    Key("iv_dl_trace", "Interventions: the intervened trace's download"),
    Key("iv_dl_zip", "Interventions: the comparison tables' download"),
    Key("iv_compare", "Interventions: compare with interventions or another checkpoint", "interventions", kept=True),
    Key("iv_other_dir", "Interventions: the other checkpoint's directory typed", "", kept=True),
    Key("iv_other_run", "Interventions: the Compare the checkpoints button"),
    Key("iv_other_result", "Interventions: the last checkpoint comparison, {base: the baseline's key, dir: as typed}"),
    Key("iv_other_zip", "Interventions: the checkpoint comparison's tables' download"),
    Key("export_preview", "Export: the table previewed"),
    Key("dl_trace", "Export: the trace file's download"),
    Key("dl_zip", "Export: every table's download"),
    Key("dl_csv_", "Export: a table's CSV download (the table)", family=True),
    Key("dl_parquet_", "Export: a table's Parquet download (the table)", family=True),
    Key("attr_csv", "Attribution: the parts' CSV download"),
    Key("generation_steps_table", "Generation: every step as a table (the expander)"),
    *(Key(f"{page}_cards", "the page's component cards (the expander)") for page in CARDED_PAGES),
    Key("atlas_source", "Atlas: bundled, a directory or an upload"),
    Key("atlas_dir", "Atlas: the directory typed"),
    Key("atlas_upload", "Atlas: the uploaded zip"),
    Key("atlas_section", "Atlas: the section shown"),
    Key("atlas_block", "Atlas: the block"),
    Key("atlas_expert", "Atlas: the expert"),
    Key("atlas_sorted", "Atlas: the expert load sorted"),
    Key("atlas_load", "Atlas: the expert load as counts or shares"),
    Key("atlas_imbalance", "Atlas: the imbalance measure"),
    Key("atlas_groups", "Atlas: group load shown"),
    Key("atlas_pairs", "Atlas: co-activation as counts or lift"),
    Key("atlas_lift", "Atlas: the lift's smoothing"),
    Key("atlas_bias", "Atlas: the routing bias's view"),
    Key("atlas_distance", "Atlas: the indexer distance's view"),
    Key("atlas_recall", "Atlas: the recall's view"),
    Key("atlas_sink_block", "Atlas: the block whose sinks are listed"),
    Key("atlas_csv_", "Atlas: a table's CSV button (the table)", family=True),
    Key("atlas_search", "Atlas: the experts table's search text"),
    Key("atlas_token", "Atlas: the token searched (its text or id)"),
    Key("atlas_token_figure", "Atlas: the searched token's experts figure"),
    Key("atlas_opened", "Atlas: the atlas this session opened last (the Router page draws its experts)"),
    Key("router_atlas_expert_", "Router: the atlas expert whose tokens in the prompt are marked (per block)", family=True),
    Key("attention_sinks_csv", "Attention: the prompt's sinks table's CSV download"),
    Key("page_drawn", "the figures and tables the page drew, for its one download (app.ui.widgets.new_page)"),
    Key("page_zip", "the page's download of all its figures and tables"),
    Key("resid_skip_first", "Residual: the stream norm with position 0 left out", kept=True),
    Key("resid_updates_skip_first", "Residual: the block's update sizes with position 0 left out", kept=True),
    Key("router_skip_first", "Router: the routed and shared outputs with position 0 left out", kept=True),
    Key("attention_skip_first", "Attention: the pattern with key 0 left out", kept=True),
    Key("attr_edges", "Attribution: the contribution graph's edges, each stream's top k or above a share", kept=True),
    Key("attr_top", "Attribution: the contribution graph's k edges per stream", kept=True),
    *(Key(f"{page}_tab", "the tab this page has open", kept=True) for page in TABBED_PAGES),
)
KEYS = {key.name: key for key in SCHEMA}
FAMILIES = tuple(key.name for key in SCHEMA if key.family)


def declared(name: str) -> bool:
    """Whether ``name`` is a key of SCHEMA, or of one of its families."""
    return name in KEYS or any(name.startswith(prefix) and name != prefix for prefix in FAMILIES)


def init() -> None:
    """Each session key with a default set once; widget values carried across pages."""
    st.session_state.setdefault("source", settings.default_source())
    st.session_state.setdefault("server_url", settings.server_url())
    for key in SCHEMA:
        if key.family:
            continue
        if key.default is not _UNSET and key.name not in st.session_state:
            st.session_state[key.name] = key.default
        if key.kept and key.name in st.session_state:
            st.session_state[key.name] = st.session_state[key.name]


def defaults() -> dict[str, Any]:
    """What a new session holds: the values a link leaves out (app.core.links)."""
    out = {key.name: key.default for key in SCHEMA if not key.family and key.default is not _UNSET}
    return {**out, "source": settings.default_source()}


def session_model() -> AppModel | None:
    """The model this session's sidebar names (loaded once per process), or None: a trace file is
    the source, or the checkpoint does not load (the sidebar shows why). For pages that trace."""
    source = st.session_state.get("source", "demo")
    if source == "upload":
        return None
    try:
        if source == "server":
            return open_server(st.session_state.get("server_url", ""))
        value = settings.default_checkpoint() if source == "demo" else st.session_state.get("ckpt_dir", "")
        return open_model(value, st.session_state.get("dtype", "bfloat16"))
    except BAD_INPUT:
        return None


@dataclass
class View:
    """What a page draws: one trace and the chosen block."""

    entry: Entry
    block: int

    @property
    def trace(self) -> Trace:
        return self.entry.trace

    @property
    def config(self) -> ModelArgs:
        return self.entry.trace.config

    @property
    def n_tokens(self) -> int:
        return self.entry.trace.n_tokens

    def tables(self) -> dict[str, pd.DataFrame]:
        return self.entry.tables()

    def table(self, name: str) -> pd.DataFrame:
        return self.entry.table(name)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        return self.entry.memo(key, compute)


def name_upload(entry: Entry, name: str) -> None:
    """Remember what this session called the trace file ``entry`` was read from. The store shares one
    entry among every session that uploads the same bytes, so the name is the session's, not the entry's."""
    st.session_state["upload_names"] = {**st.session_state.get("upload_names", {}), entry.key.sha256: name}


def origin(entry: Entry) -> str:
    """Where ``entry`` came from, for this session's people: a trace file by the name this session gave it."""
    if entry.traced:
        return entry.origin
    name = st.session_state.get("upload_names", {}).get(entry.key.sha256)
    return f"{entry.origin} {name}" if name else entry.origin


def current_entry() -> Entry | None:
    key = st.session_state.get("trace_key")
    return store().get(key) if key is not None else None


def current() -> View | None:
    entry = current_entry()
    if entry is None:
        return None
    block = int(st.session_state.get("block", 0) or 0)
    return View(entry, min(max(block, 0), entry.trace.config.n_layers - 1))
