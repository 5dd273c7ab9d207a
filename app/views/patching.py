"""Patching: activation patching between a clean and a corrupt prompt of one length. For every
site, block and position (head, expert) the corrupt run with that one clean value put back, scored
by the logit difference target - contrast after the last position (tracing.analyses.patching); heat
maps per site, the table, and one cell's patched run compared with the corrupt run.

The sweep's runs bypass the trace store (hundreds of one-cell runs would push out everyone's
traces); the session keeps the table and summary of its last sweep."""

from __future__ import annotations

import streamlit as st

from app.core.errors import BAD_INPUT
from app.core.models import AppModel
from app.topics import patching as topic
from app.topics import patching_runs as runs
from app.ui import comparison, widgets
from tracing.analyses.patching import METHODS, SITES, Cell

RESULT = "patch_result"  # {"asked": what was swept, "table": DataFrame, "summary": dict}


def page() -> None:
    om = widgets.model_page(
        "Patching",
        "Which activations carry the answer: run a corrupt prompt, put back one value of the clean run (a block's "
        "stream, its attention or FFN update, one head, one expert) at one position, and see how much of the clean "
        "logit difference returns. 1 restores the clean answer, 0 changes nothing. One forward per cell.",
        "Patching runs the model again: load a checkpoint in the sidebar (the bundled demo or a checkpoint directory). "
        "The command line: `python -m tracing patching --checkpoint DIR --clean TEXT --corrupt TEXT --out DIR`.",
    )
    if om is None:
        return
    asked = controls(om)
    if st.button("Run the sweep", type="primary", key="patch_run", icon=":material/play_arrow:"):
        run_sweep(om, asked)
    result = st.session_state.get(RESULT)
    if result is None or result["asked"] != asked:
        st.caption("Type a corrupt prompt of the clean one's length and press **Run the sweep**.")
        return
    show(om, result)


def controls(om: AppModel) -> tuple:
    key = st.session_state.get("trace_key")
    st.session_state.setdefault("patch_clean", key.prompt if key is not None and key.traced else "")
    st.session_state.setdefault("patch_corrupt", "")
    st.session_state.setdefault("patch_sites", list(SITES))
    st.session_state.setdefault("patch_positions", "all")
    left, right = st.columns(2, gap="large")
    clean = left.text_area("Clean prompt", key="patch_clean", height=80)
    corrupt = right.text_area("Corrupt prompt", key="patch_corrupt", height=80, placeholder="the same length, one word changed")
    a, b, c, d = st.columns([3, 1, 1, 1])
    sites = a.multiselect("Sites", SITES, key="patch_sites")
    positions = b.text_input("Positions", key="patch_positions", help="all, last, or A:B (positions A..B-1)")
    target = c.text_input("Target", key="patch_target", placeholder="clean top", help="a token's text or id")
    contrast = d.text_input("Contrast", key="patch_contrast", placeholder="corrupt top", help="a token's text or id")
    method = st.radio("Method", METHODS, key="patch_method", horizontal=True, help=METHOD_HELP)
    return (om.key, clean, corrupt, tuple(sites), positions.strip() or "all", target, contrast, method)


METHOD_HELP = (
    "exact: one patched forward per cell. gradient: attribution patching, every cell estimated from one backward "
    "pass of the corrupt run as grad · (clean − corrupt), the indexer's and router's selections held fixed and FP8 "
    "roundings passed straight through (docs/attribution.md)."
)


def run_sweep(om: AppModel, asked: tuple) -> None:
    _, clean, corrupt, sites, positions, target, contrast, method = asked
    bar = st.progress(0.0, text="Patching…")

    def on_cell(i: int, n: int) -> None:
        bar.progress(i / n, text=f"Cell {i + 1} of {n}…")

    try:
        result = runs.run_sweep(om, clean, corrupt, sites, positions, target, contrast, on_cell, method)
    except BAD_INPUT as exc:
        st.error(f"**Not patched.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    finally:
        bar.empty()
    st.session_state[RESULT] = {"asked": asked, "table": result.table, "summary": result.summary}


def show(om: AppModel, result: dict) -> None:
    table, s = result["table"], result["summary"]
    cols = st.columns(4)
    cols[0].metric("Clean logit difference", f"{s['clean']['logit_diff']:+.3f}")
    cols[1].metric("Corrupt logit difference", f"{s['corrupt']['logit_diff']:+.3f}")
    gradient = s["method"] == "gradient"
    cols[2].metric("Cells from one backward" if gradient else "Patched runs", f"{s['cells'] if gradient else s['runs']}")
    cols[3].metric("Time", f"{s['seconds']:.1f} s")
    labels = _labels(s)
    for site in s["sites"]:
        got = topic.grid(table, site, s["tokens"])
        if got is not None:
            widgets.chart(topic.patching_figure(*got, labels, site), key=f"patch_fig_{site}")
    widgets.table(st, table, "patching")
    widgets.csv_button(st, table, "patching.csv", "patch_csv")
    cell_view(om, result)


def _labels(s: dict) -> list[str]:
    """Position labels: the token, or clean → corrupt where the prompts differ."""
    a, b = s["clean"]["tokens"], s["corrupt"]["tokens"]
    return [f"{p} {x!r}" if x == y else f"{p} {x!r}→{y!r}" for p, (x, y) in enumerate(zip(a, b, strict=True))]


def cell_view(om: AppModel, result: dict) -> None:
    """One cell's patched run beside the corrupt run: where the put-back value changed the stream, the
    experts, the indexer's keys and the prediction."""
    table = result["table"]
    best = table.reindex(table["value"].abs().sort_values(ascending=False).index).head(30)
    options = [None, *best.index.tolist()]

    def name(i):
        if i is None:
            return "none"
        row = table.loc[i]
        which = f" {'head' if row.site == 'heads' else 'expert'} {row['index']}" if row["index"] >= 0 else ""
        return f"{row.site} block {row.block}{which} at position {row.position}: restored {row.value:+.3f}"

    st.subheader("One cell against the corrupt run", anchor=False)
    picked = st.selectbox("Cell (the 30 with the largest |value|)", options, key="patch_cell", format_func=name)
    if picked is None:
        return
    row = table.loc[picked]
    _, clean, corrupt, *_ = result["asked"]
    try:
        with st.spinner("Running the patched cell…"):
            cell = Cell(row.site, int(row.block), int(row.position), int(row["index"]))
            base, patched = runs.patched_cell(om, clean, corrupt, cell, name(picked))
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    comparison.compare(base, patched, {})


if __name__ == "__main__":
    page()
