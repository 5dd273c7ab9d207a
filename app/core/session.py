"""One browser session: it remembers only small values, its widget choices and the key of the trace
it shows (enough to make that trace again should the store have dropped it)."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import streamlit as st

from app.topics import (
    atlas,
    attention,
    attribution_runs,
    cards,
    export,
    features,
    generation,
    intervention_runs,
    model_map,
    patching,
    residual,
    router,
)
from model.config import ModelArgs
from tracing.trace import Trace

from . import settings
from .errors import BAD_INPUT
from .keys import LONGEST, UNSET, Key, flag, integer, number, one_of, optional, text
from .models import AppModel, open_model, open_server
from .traces import Entry, store

SOURCES = ("demo", "dir", "server", "upload")
TABBED_PAGES = ("model_map", "residual", "attention", "router", "generation")
CARDED_PAGES = ("residual", "attention", "router", "generation", "attribution")


# The session's own keys and the sidebar's; each page declares its own beside its code (a topic's KEYS).
SESSION_KEYS: tuple[Key, ...] = (
    Key("progress_stopped", "where each kind of long run (trace, patch, intervene) last stopped (app.ui.progress)"),
    Key("stop_", "the Stop button beside a long run's progress bar (the run's kind)", family=True),
    # the sidebar: source, model, prompt, run settings
    Key(
        "source",
        "the model source: demo, dir (a checkpoint directory), server (a model server) or upload",
        UNSET,
        link=one_of("demo", "dir", "server"),
    ),
    Key("ckpt_dir", "the checkpoint directory typed", "", kept=True, link=text(4096)),
    Key("server_url", "the model server's URL (default ANATOMY_SERVER)", UNSET, kept=True),
    Key("upload", "the uploaded trace file (the uploader's value)"),
    Key("dtype", "the activation dtype, bfloat16 or float32", "bfloat16", kept=True),
    Key("prompt", "the prompt", settings.DEFAULT_PROMPT, kept=True, link=text(LONGEST)),
    Key("run", "the Trace button"),
    Key("chat", "the prompt framed as a chat turn", False, kept=True, link=flag),
    Key("chat_thinking", "... with the answer starting in thinking mode", False, kept=True, link=flag),
    Key("gen_tokens", "new tokens written after the prompt (0: trace the prompt alone)", 0, kept=True, link=integer(0, 1 << 16)),
    Key("gen_mode", "greedy or sampled", "greedy", kept=True, link=one_of("greedy", "sampled")),
    Key("gen_temperature", "the sampling temperature", 0.8, kept=True, link=number(0.0, 100.0)),
    Key("gen_top_p", "the sampling top-p", 0.95, kept=True, link=number(0.0, 1.0)),
    Key("gen_seed", "the sampling seed; None: a new draw each time", None, kept=True, link=optional(integer(0, (1 << 63) - 1))),
    Key("block", "the block the pages show", 0, kept=True, link=integer(0, 1 << 16)),
    Key("trace_key", "the TraceKey of the trace this session shows", None),
    Key("links_loaded", "the session read its URL's view (app.core.links), on its first run"),
    Key("upload_names", "the names this session gave the trace files it opened, by content digest", {}),
    # what every page shares
    *(Key(f"{page}_cards", "the page's component cards (the expander)") for page in CARDED_PAGES),
    Key("page_drawn", "the figures and tables the page drew, for its one download (app.ui.widgets.new_page)"),
    Key("page_zip", "the page's download of all its figures and tables"),
    *(Key(f"{page}_tab", "the tab this page has open", kept=True) for page in TABBED_PAGES),
)

# the modules that declare a page's keys (their KEYS), in the order the URL's fields are written (app.core.links)
DECLARING = (
    attention,
    attribution_runs,
    intervention_runs,
    patching,
    model_map,
    cards,
    residual,
    router,
    generation,
    export,
    atlas,
    features,
)
# Every key the app keeps: tests/app/test_session.py fails on a key the app uses and this schema lacks.
SCHEMA: tuple[Key, ...] = (*SESSION_KEYS, *(key for module in DECLARING for key in module.KEYS))
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
        if key.default is not UNSET and key.name not in st.session_state:
            st.session_state[key.name] = key.default
        if key.kept and key.name in st.session_state:
            st.session_state[key.name] = st.session_state[key.name]


def defaults() -> dict[str, Any]:
    """What a new session holds: the values a link leaves out (app.core.links)."""
    out = {key.name: key.default for key in SCHEMA if not key.family and key.default is not UNSET}
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
