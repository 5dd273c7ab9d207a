"""Streamlit pieces the pages share: the page header, charts and tables (each kept for the page's
download of all its figures and tables), tabs and expanders drawn only when open, downloads, the
notices for what is missing, and the guard that keeps an unforeseen error to one line."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from contextvars import ContextVar

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from tracing.sites import INDEXER_MISSING
from tracing.tables import to_csv_bytes

from ..core.markup import escape_md
from ..core.models import AppModel
from ..core.session import View, current, origin, session_model
from ..core.traces import TraceKey
from ..topics.export import PNG_SCALE, ZIP, images_unavailable, page_zip_bytes, slug

CHART_CONFIG = {"displaylogo": False, "toImageButtonOptions": {"format": "png", "scale": 2}}
DRAWN = "page_drawn"  # session key: the page whose figures and tables were drawn, and them
log = logging.getLogger(__name__)
_owner: ContextVar[str | None] = ContextVar("drawn_by", default=None)  # the tabs drawing now (lazy_tabs)


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


def chart(fig: go.Figure, key: str | None = None, select: bool = False):
    """Draw ``fig``; ``select``: a click on a point reruns the page, and the chart's selection is returned."""
    # theme=None: the figures bring their look and their margins (topics.figures, topics.margins);
    # Streamlit's theme would restyle each one in the browser and let its margins grow in a second draw
    on = {"on_select": "rerun", "selection_mode": "points"} if select else {}
    event = st.plotly_chart(fig, width="stretch", config=CHART_CONFIG, key=key, theme=None, **on)
    title = fig.layout.title.text if fig.layout.title and fig.layout.title.text else (key or "figure")
    keep(key or title, title, fig)
    return event if select else None


def table(where, frame: pd.DataFrame, name: str) -> None:
    """A table on the page (``where``: st or a container), kept for the page's download as ``name``.csv."""
    where.dataframe(frame, hide_index=True, width="stretch")
    keep(f"table:{name}", name, frame)


def first_token_toggle(key: str, what: str = "position 0") -> bool:
    """The switch that leaves the first token out of a figure's scale, where it dominates."""
    return st.toggle(
        f"Leave out {what}",
        key=key,
        help="The first token's values are often many times the rest's: without it the colours and bars fit the others.",
    )


# --- the page's figures and tables, for one download --------------------------------------------------------
def new_page(name: str) -> None:
    """Start the page's list of drawn figures and tables (each full run of the page draws them anew)."""
    st.session_state[DRAWN] = {"page": name, "items": {}}


def drawn() -> dict[str, tuple[str | None, str, go.Figure | pd.DataFrame]]:
    """What the page drew, by key: (the tabs that drew it, its title, the figure or table)."""
    got = st.session_state.get(DRAWN)
    return got["items"] if got else {}


def keep(key: str, title: str, item: go.Figure | pd.DataFrame) -> None:
    got = st.session_state.get(DRAWN)
    if got is not None:
        got["items"][key] = (_owner.get(), title, item)


def page_downloads(name: str) -> None:
    """One button at the page's end: every figure (standalone HTML, its JSON, SVG and PNG where kaleido
    and a Chrome are at hand) and table (CSV) the page drew, in one zip. Made when clicked, from the
    list as it is then (a tab opened since adds its figures)."""
    items = drawn()
    if not items:
        return
    why = images_unavailable()
    images = f"{why}." if why else f"Also SVG and PNG (scale {PNG_SCALE}), drawn by kaleido in a Chrome (seconds a page)."
    st.divider()
    download(
        st,
        "All figures and tables (zip)",
        lambda: page_zip_bytes([(title, item) for _, title, item in items.values()]),
        f"{slug(name)}-figures.zip",
        ZIP,
        "page_zip",
        ":material/folder_zip:",
        help="Each figure as a standalone HTML file (open it in a browser, interactive) with its plotly JSON, "
        f"each table as CSV; README.txt lists them. {images}",
    )


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
    items = drawn()
    for shown in [k for k, (owner, _, _) in items.items() if owner == key]:  # the tab shown before: not drawn now
        del items[shown]
    token = _owner.set(key)
    try:
        with tab:
            views[label]()
    finally:
        _owner.reset(token)


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


def model_page(title: str, intro: str, needs: str, upload: str | None = None) -> AppModel | None:
    """The top of a page that runs the model again: its header and the session's model, or None after
    saying so (:func:`page_model`)."""
    page_header(title, intro, current())
    return page_model(needs, upload)


def page_model(needs: str, upload: str | None = None, shown: TraceKey | None = None) -> AppModel | None:
    """The session's model for a page that runs it again, or None after saying, in the page's words, how
    to load one: ``needs``, or ``upload`` while a trace file is the source. Also None when the trace
    ``shown`` was not made on that model."""
    om = session_model()
    if om is not None and (shown is None or shown.on(om)):
        return om
    from_file = upload is not None and st.session_state.get("source") == "upload"
    st.info(upload if from_file else needs, icon=":material/info:" if from_file else ":material/arrow_back:")
    return None


def no_trace() -> None:
    st.info(
        "Nothing traced yet. Choose a model source in the sidebar (the bundled demo, a checkpoint directory, "
        "or a trace file), type a prompt and press **Trace**.",
        icon=":material/arrow_back:",
    )


def no_indexer(where=st) -> None:
    """The one line an indexer view shows for a model without one (DeepSeek-V3's layout)."""
    where.info(
        f"{INDEXER_MISSING[0].upper()}{INDEXER_MISSING[1:]}: every query attends to all its earlier keys.", icon=":material/info:"
    )


def missing(what: str, sites: tuple[str, ...] | list[str], block: int | None = None) -> None:
    names = ", ".join(f"`{s.replace('{i}', '*' if block is None else str(block))}`" for s in sites)
    st.caption(f":material/visibility_off: {what}: this trace did not record {names}.")


def pick(where, label: str, options: list[int], key: str, name, help: str) -> int:
    """A selectbox that keeps its choice while the choice is among the options, else takes the first."""
    if st.session_state.get(key) not in options:
        st.session_state[key] = options[0]
    return where.selectbox(label, options, key=key, format_func=name, help=help)


def side_by_side(view: View, *charts: tuple) -> None:
    """Figures in columns, each ``(key, build, *args)`` built once per trace (memo_chart)."""
    for column, (key, build, *args) in zip(st.columns(len(charts), gap="large"), charts, strict=True):
        with column:
            memo_chart(view, key, build, *args)
