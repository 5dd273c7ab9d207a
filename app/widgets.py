"""Streamlit pieces the pages share: the page header, charts drawn once per trace, tabs and expanders
drawn only when open, downloads, the notices for what is missing, and the guard that keeps an
unforeseen error to one line."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from tracing.tables import to_csv_bytes

from .core.markup import escape_md
from .core.session import View, current, origin

CHART_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}
log = logging.getLogger(__name__)


def guarded(run: Callable[[], None], what: str) -> None:
    """Run a page (or the sidebar) so that an error nothing foresaw costs one line, not the session: a
    traceback would show strangers the server's paths and the input's values, and stop the rest of the
    script. The traceback goes to the server log. Streamlit's own rerun and stop are not Exceptions."""
    try:
        run()
    except Exception:
        log.exception("%s failed", what)
        st.error(
            f"**{what} could not be drawn** for this input: an error the app does not handle. The details are in the server log.",
            icon=":material/error:",
        )


def download(
    where,
    label: str,
    data: bytes | Callable[[], bytes],
    file_name: str,
    mime: str,
    key: str,
    icon: str | None = None,
    help: str | None = None,
) -> None:
    """A download button filling its place in the container ``where``. ``data`` may be a function:
    the bytes are then made only when clicked, and the click does not rerun the page."""
    where.download_button(
        label, data=data, file_name=file_name, mime=mime, icon=icon, key=key, on_click="ignore", width="stretch", help=help
    )


def csv_button(where, frame: pd.DataFrame, file_name: str, key: str) -> None:
    download(where, "CSV", lambda: to_csv_bytes(frame), file_name, "text/csv", key, ":material/table:")


def chart(fig: go.Figure, key: str | None = None) -> None:
    # theme=None: the figures bring their look and their margins (topics.figures, topics.margins);
    # Streamlit's theme would restyle each one in the browser and let its margins grow in a second draw
    st.plotly_chart(fig, width="stretch", config=CHART_CONFIG, key=key, theme=None)


def memo_chart(view: View, key: str, build: Callable[[], go.Figure | None], *args: Hashable) -> go.Figure | None:
    """Draw a figure built once per trace (and per ``args``: block, options): switching pages or
    blocks back and forth then costs only the serialisation. Returns None when ``build`` gave None."""
    fig = view.memo(("figure", key, *args), build)
    if fig is not None:
        chart(fig, key=key)
    return fig


def lazy_tabs(views: Mapping[str, Callable[[], None]], key: str) -> None:
    """Tabs, one per view, of which only the open one is drawn. st.tabs sends every tab's elements and
    the browser draws a hidden tab's plots as it draws a shown one's (a tenth of a second each or more):
    here opening a tab reruns the tabs alone (a fragment: not the page, not the sidebar), which draw
    that tab's view."""
    fragment(lambda: _open_tab(views, key), "This view")


def _open_tab(views: Mapping[str, Callable[[], None]], key: str) -> None:
    labels = list(views)
    tabs = st.tabs(labels, key=key, on_change="rerun")
    label, tab = next(((label, tab) for label, tab in zip(labels, tabs, strict=True) if tab.open), (labels[0], tabs[0]))
    with tab:
        views[label]()


def fragment(draw: Callable[[], None], what: str) -> None:
    """Draw a part of the page that its own widgets rerun alone (st.fragment), guarded as the page is:
    its reruns do not pass through the page's guard."""
    st.fragment(lambda: guarded(draw, what))()


def lazy_expander(label: str, key: str, icon: str | None = None):
    """An expander whose content is drawn only while it is open: the container, or None while closed."""
    box = st.expander(label, key=key, icon=icon, on_change="rerun")
    return box if box.open else None


def page_header(title: str, intro: str, view: View | None) -> None:
    st.header(title, anchor=False)
    st.caption(intro)
    if view is not None:
        trace = view.trace
        prompt = trace.prompt if trace.prompt else " ".join(trace.tokens[:12])
        shown = prompt if len(prompt) <= 140 else prompt[:139] + "…"
        kind = "MoE" if view.config.is_moe(view.block) else "dense"
        source = escape_md(origin(view.entry))
        st.markdown(
            f":gray-badge[:material/notes: {trace.n_tokens} tokens] :gray-badge[:material/memory: {source}] "
            f":blue-badge[block {view.block} · {kind}]  “{escape_md(shown)}”"
        )


def page_view(title: str, intro: str) -> View | None:
    """The page's header and the trace and block it shows, or None after saying nothing is traced yet."""
    view = current()
    page_header(title, intro, view)
    if view is None:
        no_trace()
    return view


def no_trace() -> None:
    st.info(
        "Nothing traced yet. Choose a model source in the sidebar (the bundled demo, a checkpoint directory, "
        "or a trace file), type a prompt and press **Trace**.",
        icon=":material/arrow_back:",
    )


def missing(what: str, sites: tuple[str, ...] | list[str], block: int | None = None) -> None:
    names = ", ".join(f"`{s.replace('{i}', '*' if block is None else str(block))}`" for s in sites)
    st.caption(f":material/visibility_off: {what}: this trace did not record {names}.")
