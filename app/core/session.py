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
from .models import OpenModel, open_model
from .traces import Entry, store

SOURCES = ("demo", "dir", "upload")
_DEFAULTS: dict[str, Any] = {
    "source": "demo",
    "ckpt_dir": "",
    "prompt": settings.DEFAULT_PROMPT,
    "dtype": "bfloat16",
    "block": 0,
    "trace_key": None,  # the TraceKey of the trace this session shows
    "gen_tokens": 0,  # new tokens written after the prompt (0: trace the prompt alone)
    "gen_mode": "greedy",  # greedy | sampled
    "gen_temperature": 0.8,
    "gen_top_p": 0.95,
    "gen_seed": None,  # None: a new draw each time
    "chat": False,  # the prompt framed as a chat turn
    "chat_thinking": False,  # ... with the answer starting in thinking mode
}
# widget values Streamlit would forget while their widget is not drawn (another page, another source)
_KEEP = (
    "ckpt_dir",
    "prompt",
    "dtype",
    "block",
    "anatomy_component",
    "query",
    "attention_head",
    "router_biased",
    "gen_tokens",
    "gen_mode",
    "gen_temperature",
    "gen_top_p",
    "gen_seed",
    "gen_step",
    "chat",
    "chat_thinking",
    "model_map_tab",  # the tab each page has open
    "residual_tab",
    "attention_tab",
    "router_tab",
    "generation_tab",
    "attr_position",
    "attr_target",
    "attr_contrast",
    "attr_threshold",
)


def init() -> None:
    """Each session key set once; widget values carried across pages."""
    for key, value in _DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value
    for key in _KEEP:
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]


def session_model() -> OpenModel | None:
    """The model this session's sidebar names (loaded once per process), or None: a trace file is
    the source, or the checkpoint does not load (the sidebar shows why). For pages that trace."""
    source = st.session_state.get("source", "demo")
    if source == "upload":
        return None
    value = settings.default_checkpoint() if source == "demo" else st.session_state.get("ckpt_dir", "")
    try:
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


def current_entry() -> Entry | None:
    key = st.session_state.get("trace_key")
    return store().get(key) if key is not None else None


def current() -> View | None:
    entry = current_entry()
    if entry is None:
        return None
    block = int(st.session_state.get("block", 0) or 0)
    return View(entry, min(max(block, 0), entry.trace.config.n_layers - 1))
