"""The app's one progress bar for long runs (a trace, a patching sweep, an intervened run), with a Stop
that keeps the page usable.

Streamlit ends a running script at its next element when the reader presses Stop (``StopException``,
after which nothing more can be drawn in that run) or touches any widget (``RerunException``, the page
is drawn again at once). Either way the run's work is lost, and Streamlit's own Stop leaves the bar
drawn where it froze. So the bar carries its own **Stop** button (a click reruns the page: the bar is
gone and the page draws its last result), and an ended run leaves behind where it stopped, which the
page shows beside the result it kept until the next run of the same kind."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import streamlit as st
from streamlit.runtime.scriptrunner_utils.exceptions import ScriptControlException

from ..core.markup import escape_md

STOPPED = "progress_stopped"  # session key: {run name: where that run stopped}


@contextmanager
def progress(where, name: str, text: str) -> Iterator[Callable[[float, str], None]]:
    """A bar in the container ``where`` for the run ``name`` (one per page: "trace", "patch"...), and
    its Stop; yields ``step(fraction, text)``. A run ended by Stop or by a widget records where it
    stopped (:func:`stopped`); the one before it is forgotten when it starts."""
    stops = st.session_state.setdefault(STOPPED, {})
    stops.pop(name, None)
    box = where.container()
    bar = box.progress(0.0, text=text)
    box.button("Stop", key=f"stop_{name}", icon=":material/stop:", help="Stop this run: the page keeps its last result")
    at = [text]

    def step(fraction: float, text: str) -> None:
        bar.progress(min(max(fraction, 0.0), 1.0), text=text)  # raises when the run is to end here
        at[0] = text

    try:
        yield step
    except ScriptControlException:
        stops[name] = at[0].rstrip("…. ")
        raise
    finally:
        box.empty()  # after Streamlit's Stop this raises StopException again: nothing can be drawn then


def stopped(name: str) -> str | None:
    """Where the last run ``name`` stopped (its bar's last text: "Cell 12 of 40"), or None when it ran
    to its end."""
    return st.session_state.get(STOPPED, {}).get(name)


def stopped_notice(where, name: str, kept: str) -> bool:
    """Say in ``where`` where the last run ``name`` stopped and what the page shows instead (``kept``);
    False when it was not stopped."""
    at = stopped(name)
    if at is None:
        return False
    where.warning(f"**Stopped:** {escape_md(at)}. {kept}", icon=":material/stop_circle:")
    return True
