"""Block anatomy: one card per component, in the order of the forward pass, for the chosen block."""

from __future__ import annotations

import streamlit as st

from app.topics import cards
from app.ui import card_view, widgets

ALL = "all"
SHORT = {
    "embedding": "Embedding",
    "block": "Block",
    "rmsnorm": "RMSNorm + add",
    "mla": "MLA",
    "indexer": "Indexer",
    "sparse_mask": "Sparse mask",
    "mlp": "Dense MLP",
    "router": "Router",
    "experts": "Experts",
    "head": "Norm + head",
}


def page() -> None:
    view = widgets.page_view(
        "Block anatomy",
        "Each component of DeepSeek-V3.2-Exp: its equation, its tensor shapes for this config (and for your "
        "prompt), the project's code that computed it, and a live plot for the chosen block.",
    )
    if view is None:
        return
    all_cards = cards.load_cards()
    ids = list(all_cards)
    st.session_state.setdefault("anatomy_component", "block")
    choice = st.pills(
        "Component (forward order)",
        [*ids, ALL],
        key="anatomy_component",
        required=True,
        format_func=lambda i: "All, top to bottom" if i == ALL else SHORT.get(i, all_cards[i].title),
    )
    shown = ids if choice == ALL else [choice or "block"]
    for card_id in shown:
        card_view.card(all_cards[card_id], view, key=f"anatomy_{card_id}")
    if choice != ALL:
        _walk(ids, shown[0], all_cards)


def _walk(ids: list[str], current: str, all_cards: dict) -> None:
    """Previous / next component buttons, so the forward pass reads like pages of a book."""
    i = ids.index(current)
    ends = "right" if i == 0 else "left" if i == len(ids) - 1 else "distribute"
    row = st.container(horizontal=True, horizontal_alignment=ends)  # one flex row: fewer elements than columns
    if i > 0:
        row.button(f"← {all_cards[ids[i - 1]].title}", key="anatomy_prev", on_click=_go, args=(ids[i - 1],))
    if i < len(ids) - 1:
        row.button(f"{all_cards[ids[i + 1]].title} →", key="anatomy_next", on_click=_go, args=(ids[i + 1],))


def _go(card_id: str) -> None:
    st.session_state["anatomy_component"] = card_id


if __name__ == "__main__":
    page()
