"""A component card on a page: its equation, its shapes resolved for this config and prompt, its
facts and prose, the live plot for the chosen block and the code that ran (content: app.topics.cards)."""

from __future__ import annotations

from functools import partial

import streamlit as st

from tracing.sites import is_indexer_site

from ..core.pages import PAGES
from ..core.session import View
from ..topics import card_plots, cards
from ..topics.attention import recorded_heads
from ..topics.attribution import CARD_PARTS
from .widgets import fragment, lazy_expander, lazy_tabs, memo_chart, missing, no_indexer, page_view

ATTRIBUTION = next(p for p in PAGES if p.name == "attribution")


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
    block, note = card_plots.applicable_block(card.scope, view.config, view.block)
    values = cards.facts_for(view.config, block if block is not None else view.block, view.n_tokens)
    with st.container(border=True):
        st.markdown(f"#### {card.title}")
        st.caption(card.summary)
        if (part := CARD_PARTS.get(card.id)) is not None:
            where = "" if part.startswith("the") else f" (block {view.block})"
            st.page_link(str(ATTRIBUTION.file), label=f"Attribution: {part}{where}", icon=ATTRIBUTION.icon)
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
    if not view.config.has_indexer and any(is_indexer_site(site) for site in card.sites):
        no_indexer()
        return
    plot = card_plots.PLOTS.get(card.plot)
    if plot is None:
        st.caption(f"No plot named {card.plot!r}.")
        return
    options = {}
    if card.plot == "attention_pattern":
        heads = recorded_heads(view.trace, block)
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
    """The cards of a view page, one tab each, in an expander drawn when opened: equations, shapes and
    code beside the views below. Closed, they cost nothing; KaTeX redraws every equation on each rerun.
    Opening it reruns the expander alone."""
    all_cards = cards.load_cards()
    chosen = {c.title: c for c in (all_cards[i] for i in ids if i in all_cards)}
    label = f"Equations, shapes and code: {', '.join(chosen)}"

    def draw() -> None:
        box = lazy_expander(label, f"{key}_cards", icon=":material/function:")
        if box is not None:
            with box:
                views = {t: partial(card, c, view, full=False, key=f"{key}_{c.id}") for t, c in chosen.items()}
                lazy_tabs(views, f"{key}_card")

    fragment(draw, "The cards")


def topic_page(title: str, intro: str, card_ids: list[str], key: str) -> View | None:
    """A topic page's top: its header and the topic's cards (one tab each, drawn when opened). The
    view the page shows, or None when nothing is traced yet (the page has said so)."""
    view = page_view(title, intro)
    if view is not None:
        compact_cards(card_ids, view, key)
    return view
