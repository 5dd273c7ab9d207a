"""The view in the URL: the settings a reader would need to see the same thing again (source,
prompt, chat and generation settings, block, a page's position, target, graph edges and
interventions) are kept in the query string, so a reload or a shared link reopens the same view.
The page is the URL's path (Streamlit's navigation).

Each session key says whether a link carries it and how its value reads (app.core.keys: a link is a
visitor's input, read by its own type and bound); a value that does not read is dropped and named in
one warning, never raised. Only values that differ from a new session's are written, so a plain
visit keeps a clean URL.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any

from .session import SCHEMA

LOADED = "links_loaded"  # the session read its URL already (once, on its first run)
# session key -> how its URL value reads: each key that declares a link (app.core.keys.Key.link)
LINKED: dict[str, Callable[[str], Any]] = {key.name: key.link for key in SCHEMA if key.link is not None}


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
