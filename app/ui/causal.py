"""The causal check of an attribution: the block's strongest head and expert one click from the
Interventions page (removed there at the attributed position), or the N largest parts removed here one
run each and the attributed logit measured again (app.topics.attribution_runs.causal)."""

from __future__ import annotations

import streamlit as st

from app.core.errors import BAD_INPUT
from app.core.models import AppModel
from app.core.pages import PAGES
from app.core.session import View
from app.core.traces import TraceKey
from app.topics import attribution as topic
from app.topics import attribution_runs as runs
from app.topics import interventions

from . import widgets

INTERVENTIONS = next(p for p in PAGES if p.name == "interventions")


def removals(view: View, block: int) -> None:
    """The causal check one click away: the block's head and expert with the largest |part|, the larger
    first, removed at the attributed position only on the Interventions page (a head ablated, an
    expert's output zeroed with its routing kept)."""
    candidates = view.memo(("attr_strongest", block), lambda: interventions.strongest(view.trace, block))
    candidates = sorted(candidates, key=lambda c: -abs(c[2]))
    position = topic.attributed(view.trace)["position"]
    for column, (key, index, value) in zip(st.columns(max(len(candidates), 1)), candidates, strict=False):
        verb, what = ("Ablate", "head") if key == "ablate_heads" else ("Zero", "expert")
        label = f"{verb} {what} {block}:{index} at position {position} (part {value:+.3f}) on the Interventions page"
        tip = (
            "Removed at the attributed position only, like with like; the Interventions page compares the runs after the "
            "last position (the baseline's top token's logit). The causal check below measures the attributed logit."
        )
        if column.button(label, key=f"attr_remove_{key}", icon=INTERVENTIONS.icon, help=tip):
            interventions.ask_to_remove(st.session_state, key, block, index, position)
            st.switch_page(str(INTERVENTIONS.file))


def causal_view(om: AppModel, plain: TraceKey, view: View) -> None:
    """The causal check of the attribution: each of the N largest heads and experts removed at the
    attributed position only, the attributed logit measured again (tracing.analyses.causal)."""
    st.subheader("Causal check", anchor=False)
    st.caption(
        "Each of the largest heads and routed experts removed at the attributed position only (a head ablated, an "
        "expert's output zeroed with its routing kept), and the same logit measured again: the effect is the plain "
        "value less the value without the part. One run per part."
    )
    st.session_state.setdefault("attr_causal_n", 5)
    left, right = st.columns([1, 3], vertical_alignment="bottom")
    n = int(left.number_input("Parts", min_value=1, max_value=20, step=1, key="attr_causal_n"))
    asked = (view.entry.key, n)
    if right.button("Remove each and measure", key="attr_causal_run", icon=":material/science:"):
        st.session_state["attr_causal_for"] = asked
    if st.session_state.get("attr_causal_for") != asked:
        return
    try:
        with st.spinner(f"Removing {n} parts, one run each…"):
            table = runs.causal(om, plain, view.entry, n)
    except BAD_INPUT as exc:
        st.error(f"**Not checked.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    r = table.attrs["correlation"]
    st.markdown(f"Correlation of the attributed values and the measured effects: **{r:+.3f}** over {len(table)} parts.")
    widgets.table(st, table, "causal check")
    widgets.csv_button(st, table, "causal.csv", "attr_causal_csv")
