"""Streamlit pieces the pages share: page header, charts, component cards, the no-trace notice."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from tracing.tables import to_csv_bytes

from . import card_plots, cards, shaping
from .state import View

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


def csv_button(where, frame: pd.DataFrame, file_name: str, key: str) -> None:
    """A table's CSV download in the container ``where``; the CSV is made only when clicked."""
    where.download_button(
        "CSV",
        data=lambda: to_csv_bytes(frame),
        file_name=file_name,
        mime="text/csv",
        key=key,
        on_click="ignore",
        icon=":material/table:",
        width="stretch",
    )


def chart(fig: go.Figure, key: str | None = None) -> None:
    st.plotly_chart(fig, width="stretch", config=CHART_CONFIG, key=key, theme="streamlit")


def memo_chart(view: View, key: str, build: Callable[[], go.Figure | None], *args: Hashable) -> go.Figure | None:
    """Draw a figure built once per trace (and per ``args``: block, options): switching pages or
    blocks back and forth then costs only the serialisation. Returns None when ``build`` gave None."""
    fig = view.memo(("figure", key, *args), build)
    if fig is not None:
        chart(fig, key=key)
    return fig


def page_header(title: str, intro: str, view: View | None) -> None:
    st.header(title, anchor=False)
    st.caption(intro)
    if view is not None:
        trace = view.trace
        prompt = trace.prompt if trace.prompt else " ".join(trace.tokens[:12])
        shown = prompt if len(prompt) <= 140 else prompt[:139] + "…"
        kind = "MoE" if view.config.is_moe(view.block) else "dense"
        st.markdown(
            f":gray-badge[:material/notes: {trace.n_tokens} tokens] :gray-badge[:material/memory: {view.entry.origin}] "
            f":blue-badge[block {view.block} · {kind}]  “{escape_md(shown)}”"
        )


def escape_md(text: str) -> str:
    """Text shown as itself in Markdown: a path's underscores or a file name's brackets stay literal."""
    for ch in "\\`*_[]<>#|$~":
        text = text.replace(ch, "\\" + ch)
    return text.replace("\n", " ")


def no_trace() -> None:
    st.info(
        "Nothing traced yet. Choose a model source in the sidebar (the bundled demo, a checkpoint directory, "
        "or a trace file), type a prompt and press **Trace**.",
        icon=":material/arrow_back:",
    )


def missing(what: str, sites: tuple[str, ...] | list[str], block: int | None = None) -> None:
    names = ", ".join(f"`{s.replace('{i}', '*' if block is None else str(block))}`" for s in sites)
    st.caption(f":material/visibility_off: {what}: this trace did not record {names}.")


def _shape_lines(specs: tuple[cards.TensorSpec, ...], view: View) -> list[str]:
    out = []
    for spec in specs:
        line = f"- ${spec.symbol}$ `{cards.shape_text(spec.dims, view.config)}`"
        try:
            here = cards.shape_here(spec.dims, view.config, view.n_tokens)
            if any(d in ("B", "T", "S", "N", "K") for d in (x.split(":")[0] for x in spec.dims)):
                line += f" → here `{here}`"
        except cards.CardError:
            pass
        if spec.dtype:
            line += f" · {spec.dtype}"
        if spec.what:
            line += f" — {spec.what}"
        out.append(line)
    return out


def shapes(card: cards.Card, view: View) -> None:
    parts = []
    for title, specs in (("In", card.inputs), ("Parameters", card.params), ("Out", card.outputs)):
        if specs:
            parts.append(f"**{title}**\n" + "\n".join(_shape_lines(specs, view)))
    st.markdown("\n\n".join(parts))


def code(card: cards.Card) -> None:
    for anchor in card.code:
        try:
            ex = cards.excerpt(anchor)
        except cards.CardError as exc:
            st.warning(str(exc))
            continue
        st.caption(f":material/code: `{ex.path}` lines {ex.start}–{ex.end} · `{anchor.ref}`")
        st.code(ex.text(), language="python")


def card(card: cards.Card, view: View, *, full: bool = True, key: str = "") -> None:
    """A component card: equation, shapes resolved for this config and prompt, facts, prose, the live
    plot for the chosen block (full) and the code that ran. Compact cards leave the plot to the page."""
    block, note = card_plots.applicable_block(card.scope, view, view.block)
    values = cards.facts_for(view.config, block if block is not None else view.block, view.n_tokens)
    with st.container(border=True):
        st.markdown(f"#### {card.title}")
        st.caption(card.summary)
        for equation in card.equations:
            st.latex(equation)
        if full:
            left, right = st.columns([10, 11], gap="large")
        else:
            left, right = st.container(), None
        with left:
            shapes(card, view)
            if card.facts:
                st.caption(" · ".join(cards.fill(f, values) for f in card.facts))
            st.markdown(cards.fill(card.explanation, values))
        if right is not None:
            with right:
                live_plot(card, view, block, note, key)
        if full:
            code(card)
        else:
            with st.expander(f"Code that ran: {', '.join(_anchor_titles(card))}"):
                code(card)


def _anchor_titles(card: cards.Card) -> list[str]:
    out = []
    for anchor in card.code:
        try:
            out.append(cards.excerpt(anchor).title)
        except cards.CardError:
            out.append(anchor.ref)
    return out


def live_plot(card: cards.Card, view: View, block: int | None, note: str, key: str) -> None:
    if note:
        st.caption(f":material/info: {note}")
    if block is None:
        return
    plot = card_plots.PLOTS.get(card.plot)
    if plot is None:
        st.caption(f"No plot named {card.plot!r}.")
        return
    options = {}
    if card.plot == "attention_pattern":
        heads = shaping.recorded_heads(view.trace, block)
        if heads:
            choice = st.selectbox(
                "Heads",
                ["mean", *range(heads)],
                key=f"{key}_head",
                format_func=lambda h: "mean over heads" if h == "mean" else f"head {h}",
            )
            options["head"] = None if choice == "mean" else int(choice)
    fig = memo_chart(view, f"{key}_plot", lambda: plot(view, block, **options), card.plot, block, options.get("head"))
    if fig is None:
        missing("No live plot", card.sites, block)


def compact_cards(ids: list[str], view: View, key: str) -> None:
    """The cards of a view page, one tab each: equations, shapes and code beside the views below."""
    all_cards = cards.load_cards()
    chosen = [all_cards[i] for i in ids if i in all_cards]
    tabs = st.tabs([c.title for c in chosen])
    for tab, c in zip(tabs, chosen, strict=True):
        with tab:
            card(c, view, full=False, key=f"{key}_{c.id}")
