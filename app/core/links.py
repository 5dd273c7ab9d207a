"""The view in the URL: the settings a reader would need to see the same thing again (source,
prompt, chat and generation settings, block, a page's position, target, graph edges and
interventions) are kept in the query string, so a reload or a shared link reopens the same view.
The page is the URL's path (Streamlit's navigation).

A link is a visitor's input: each value is read by its own type and bound (a prompt of at most
LONGEST characters, numbers of ASCII digits in range, one of a few words), and a value that does not
read is dropped and named in one warning, never raised. Only values that differ from a new
session's are written, so a plain visit keeps a clean URL.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from tracing.cli.inputs import parse_float, parse_int
from tracing.errors import InputError

LONGEST = 20_000  # characters of a prompt, as the sidebar's field takes
LOADED = "links_loaded"  # the session read its URL already (once, on its first run)


def _integer(low: int, high: int) -> Callable[[str], int]:
    """The command line's integer rule (ASCII digits, in range): ValueError when it does not read."""

    def read(text: str) -> int:
        try:
            return parse_int(text, "", low, high)
        except InputError:
            raise ValueError(text) from None

    return read


def _number(low: float, high: float) -> Callable[[str], float]:
    """The command line's finite-float rule, in range."""

    def read(text: str) -> float:
        try:
            value = parse_float(text, "")
        except InputError:
            raise ValueError(text) from None
        if not low <= value <= high:
            raise ValueError(text)
        return value

    return read


def _one_of(*words: str) -> Callable[[str], str]:
    def read(text: str) -> str:
        if text not in words:
            raise ValueError(text)
        return text

    return read


def _flag(text: str) -> bool:
    return {"1": True, "0": False}[text]


def _text(longest: int) -> Callable[[str], str]:
    def read(text: str) -> str:
        if len(text) > longest:
            raise ValueError(text[:20])
        return text

    return read


def _optional(read: Callable[[str], Any]) -> Callable[[str], Any]:
    return lambda text: None if text == "" else read(text)


POSITION = _optional(_integer(0, 1 << 20))
TOKEN = _optional(_integer(-1, 1 << 24))
# session key -> how its URL value reads (what is written back is str(value), flags as 1/0)
LINKED: dict[str, Callable[[str], Any]] = {
    "source": _one_of("demo", "dir", "server"),  # a trace file cannot travel in a link
    "ckpt_dir": _text(4096),
    "prompt": _text(LONGEST),
    "chat": _flag,
    "chat_thinking": _flag,
    "gen_tokens": _integer(0, 1 << 16),
    "gen_mode": _one_of("greedy", "sampled"),
    "gen_temperature": _number(0.0, 100.0),
    "gen_top_p": _number(0.0, 1.0),
    "gen_seed": _optional(_integer(0, (1 << 63) - 1)),
    "block": _integer(0, 1 << 16),
    "query": POSITION,
    "attr_position": POSITION,
    "attr_target": TOKEN,
    "attr_contrast": TOKEN,
    "attr_edges": _one_of("top k per stream", "above a share"),  # the contribution graph's controls, in their bounds
    "attr_top": _integer(1, 20),
    "attr_threshold": _number(0.01, 0.5),
    "iv_at": _text(64),
    "iv_no_bias": _flag,
    "iv_attention": _one_of("model", "dense", "topk"),
    "iv_no_act_fp8": _flag,
    "patch_clean": _text(LONGEST),
    "patch_corrupt": _text(LONGEST),
}


def restore(state: MutableMapping, params: MutableMapping) -> list[str]:
    """Once per session, before any widget: the URL's values into the session. Returns the names of
    the values that did not read (dropped)."""
    if state.get(LOADED):
        return []
    state[LOADED] = True
    dropped = []
    for name, read in LINKED.items():
        if name not in params:
            continue
        try:
            state[name] = read(str(params[name]))
        except (ValueError, KeyError, OverflowError):
            dropped.append(name)
    return dropped


def store(state: MutableMapping, params: MutableMapping, defaults: dict[str, Any]) -> None:
    """The session's linked values into the URL: those that differ from a new session's; the others
    removed. A trace file's session links to the page alone."""
    upload = state.get("source") == "upload"
    for name in LINKED:
        value = state.get(name)
        kept = not upload and name in state and value != defaults.get(name) and value is not None
        text = ("1" if value else "0") if isinstance(value, bool) else str(value)
        if kept and params.get(name) != text:
            params[name] = text
        elif not kept and name in params:
            del params[name]
