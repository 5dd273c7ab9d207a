"""Patching: activation patching between a clean and a corrupt prompt of one length. For every
site, block and position (head, expert) the corrupt run with that one clean value put back, scored
by the logit difference target - contrast after the last position (tracing.analyses.patching); heat
maps per site, the table, and one cell's patched run compared with the corrupt run.

The sweep's runs bypass the trace store (hundreds of one-cell runs would push out everyone's
traces); the session keeps the table and summary of its last sweep."""

from __future__ import annotations

import hashlib

import streamlit as st

from app.core.errors import BAD_INPUT
from app.core.models import AppModel
from app.topics import patching as topic
from app.topics import patching_runs as runs
from app.ui import comparison, progress, widgets
from tracing.analyses.patching import METHODS, SITES, Cell
from tracing.analyses.prompt_sets import MAX_BYTES

RESULT = "patch_result"  # {"asked": what was swept, "table": DataFrame, "summary": dict}
PAIRS = "patch_pairs_result"  # {"asked": what was swept, "table": the means, "each": every pair's rows, "summary": dict}


def page() -> None:
    widgets.page_header(
        "Patching",
        "Which activations carry the answer: run a corrupt prompt, put back one value of the clean run (a block's "
        "stream, its attention or FFN update, one head, one expert) at one position, and see how much of the clean "
        "logit difference returns. 1 restores the clean answer, 0 changes nothing. One forward per cell.",
        None,  # the page shows its pair, not the sidebar's trace
    )
    pair = st.empty()
    om = widgets.page_model(
        "Patching runs the model again: load a checkpoint in the sidebar (the bundled demo or a checkpoint directory). "
        "The command line: `python -m tracing patching --checkpoint DIR --clean TEXT --corrupt TEXT --out DIR`."
    )
    if om is None:
        return
    asked = controls(om)
    if st.button("Run the sweep", type="primary", key="patch_run", icon=":material/play_arrow:"):
        run_sweep(om, asked)
    result = st.session_state.get(RESULT)
    kept = "The page shows the last complete sweep." if result is not None else "No sweep ran to its end yet."
    stopped = progress.stopped_notice(st, "patch", kept)
    if result is None or (result["asked"] != asked and not stopped):
        pair.markdown(topic.pair_header(om.label, asked[1], asked[2]))
        st.caption("Type a corrupt prompt of the clean one's length and press **Run the sweep**.")
    else:
        pair.markdown(topic.pair_header(om.label, result["asked"][1], result["asked"][2], result["summary"]["tokens"]))
        show(om, result)
    pairs_section(om, asked)


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
    try:
        with progress.progress(st, "patch", "Patching…") as step:
            on_cell = lambda i, n: step(i / n, f"Cell {i + 1} of {n}…")  # noqa: E731
            result = runs.run_sweep(om, clean, corrupt, sites, positions, target, contrast, on_cell, method)
    except BAD_INPUT as exc:
        st.error(f"**Not patched.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state[RESULT] = {"asked": asked, "table": result.table, "summary": result.summary}


def show(om: AppModel, result: dict) -> None:
    table, s = result["table"], result["summary"]
    cols = st.columns(4)
    cols[0].metric("Clean logit difference", f"{s['clean']['logit_diff']:+.3f}")
    cols[1].metric("Corrupt logit difference", f"{s['corrupt']['logit_diff']:+.3f}")
    gradient = s["method"] == "gradient"
    cols[2].metric("Cells from one backward" if gradient else "Patched runs", f"{s['cells'] if gradient else s['runs']}")
    cols[3].metric("Time", f"{s['seconds']:.1f} s")
    for site in s["sites"]:
        fig = topic.map_figure(table, site, s)
        if fig is not None:
            widgets.chart(fig, key=f"patch_fig_{site}")
    widgets.table(st, table, "patching")
    widgets.csv_button(st, table, "patching.csv", "patch_csv")
    cell_view(om, result)


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


def pairs_section(om: AppModel, asked: tuple) -> None:
    """A file of pairs swept with the sites, positions, target and contrast above: per cell the mean
    over the pairs with its 95% bootstrap interval (the pairs resampled), and every pair's rows."""
    st.subheader("A set of pairs", anchor=False)
    upload = st.file_uploader(
        "Pairs file",
        type=["jsonl", "csv"],
        key="patch_pairs_file",
        max_upload_size=max(1, MAX_BYTES >> 20),
        help="JSONL, one object a line with clean, corrupt and optionally target, contrast; or CSV with those "
        "columns. As `python -m tracing patching --pairs FILE`.",
    )
    if upload is None:
        st.caption("One pair proves little: drop a file of pairs to sweep each and see every cell's mean with its interval.")
        return
    data = upload.getvalue()
    key = (hashlib.sha256(data).hexdigest(), om.key, *asked[3:])  # the file, the model and the sweep's settings
    if st.button("Sweep every pair", key="patch_pairs_run", icon=":material/play_arrow:"):
        _, _, _, sites, positions, target, contrast, method = asked
        try:
            with progress.progress(st, "patch_pairs", "Patching the pairs…") as step:
                on_pair = lambda i, n: step(i / n, f"Pair {i + 1} of {n}…")  # noqa: E731
                result = runs.run_pairs(om, data, upload.name, sites, positions, target, contrast, on_pair, method)
        except BAD_INPUT as exc:
            st.error(f"**Not patched.** {widgets.escape_md(str(exc))}", icon=":material/error:")
            return
        st.session_state[PAIRS] = {"asked": key, "table": result.table, "each": result.each, "summary": result.summary}
    result = st.session_state.get(PAIRS)
    if result is None or result["asked"] != key:
        st.caption("Press **Sweep every pair**: one sweep per pair, with the sites and positions above.")
        return
    table, s = result["table"], result["summary"]
    st.caption(
        f"{s['pairs']} pairs, {s['runs']} patched runs in {s['seconds']:.1f} s. Each cell: the mean restored share over "
        f"the pairs and its 95% bootstrap interval (the pairs resampled, seed {s['seed']}); "
        + ("positions counted from the end (-1 the last), as the pairs differ in length." if s["tokens"] is None else "")
    )
    frame, width, labels = topic.mean_grid(table, s["tokens"])
    for site in dict.fromkeys(table["site"]):
        got = topic.grid(frame, site, width)
        if got is not None:
            widgets.chart(topic.patching_figure(*got, labels, site), key=f"patch_pairs_fig_{site}")
    widgets.table(st, table, "patching_mean")
    left, right = st.columns(2)
    widgets.csv_button(left, table, "patching_mean.csv", "patch_pairs_csv")
    widgets.csv_button(right, result["each"], "patching_pairs.csv", "patch_pairs_each_csv")


if __name__ == "__main__":
    page()
