"""Interventions: change one thing (ablate experts, zero their outputs, ablate attention heads, route
without the correction bias, dense attention or another index_topk), run the prompt again, and
compare the two traces side by side: where the residual stream starts to move, which experts and
keys changed, and how the predictions moved. Or run the prompt on another checkpoint of the same
tokenizer (V3.1-Terminus against V3.2-Exp) and compare the two models block by block.

The session keeps only the widgets' values and the last run's spec (small dicts, read by
tracing.analyses.intervention_specs.from_spec); the baseline and the intervened trace live in the process-wide
store (app.core.traces), the diff tables and figures in the intervened entry's memo.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from app.core import paths
from app.core.errors import BAD_INPUT
from app.core.models import AppModel
from app.core.traces import Entry
from app.topics import intervention_runs as runs
from app.topics.interventions import ARRIVING
from app.ui import comparison, intervention_controls, progress, widgets

RESULT = "iv_result"  # {"base": the baseline's store key, "spec": what was run, "graph": its fingerprint or None}
COMPARE = {"interventions": "interventions on this checkpoint", "checkpoint": "another checkpoint"}
OTHER = "iv_other_result"  # {"base": the baseline's store key, "dir": the other checkpoint as typed}


# --- the page --------------------------------------------------------------------------------------------------
def page() -> None:
    om = widgets.model_page(
        "Interventions",
        "Change one thing and watch what moves: ablate experts (the router goes around them), zero experts' outputs "
        "(still chosen, writing nothing), ablate attention heads, route without the correction bias, or attend to "
        "every key (or another number of them). The prompt runs again and the two traces are compared block by block; "
        "removing the head or expert with the largest part on the Attribution page is its causal check.",
        "Interventions run the model again: load a checkpoint in the sidebar (the bundled demo or a checkpoint directory) first.",
        upload="Interventions run the model again, and a trace file holds no model. Choose **Bundled demo** or a "
        "**Checkpoint directory** in the sidebar to run one; two trace files of one prompt compare on the "
        "command line: `python -m tracing diff A.safetensors B.safetensors --csv DIR`.",
    )
    if om is None:
        return
    base = baseline(om)
    if base is None:
        return
    if compare_mode() == "checkpoint":
        other_checkpoint(om, base)
        return
    cfg = om.args
    arrived = runs.arrive(st.session_state)
    runs.keep(st.session_state, cfg)
    intervention_controls.controls(base, cfg)
    st.file_uploader(
        "Intervention graph (optional)",
        type=["json", "safetensors"],
        accept_multiple_files=True,
        key="iv_graph",
        help="A graph file (docs/graphs.md): reads, arithmetic, writes and saves at trace sites, applied at every "
        "pass after the interventions above; with the .safetensors file it names when it has tensor constants. "
        "It runs as `python -m tracing run --graph FILE.json` does.",
    )
    run = st.button("Run with these interventions", type="primary", key="iv_run", icon=":material/play_arrow:")
    if run or arrived:
        run_now(om, base, cfg)
    result = st.session_state.get(RESULT)
    progress.stopped_notice(st, "intervene", "The page shows the last complete run." if result else "No run ended yet.")
    if result is None:
        st.caption("Choose one or more interventions above and press **Run with these interventions**.")
        return
    if result["base"] != base.key:
        st.info(
            "The prompt or the model changed since the last run: press **Run with these interventions** to compare "
            "on this trace.",
            icon=":material/refresh:",
        )
        return
    try:
        graph = uploaded_graph()
    except BAD_INPUT as exc:
        st.error(f"**The graph file is not usable.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    if (graph.fingerprint() if graph is not None else None) != result.get("graph"):
        st.info("The graph file changed since the last run: press **Run with these interventions**.", icon=":material/refresh:")
        return
    iv = intervened(om, base, result["spec"], graph)
    if iv is not None:
        comparison.compare(base, iv, result["spec"])


def compare_mode() -> str:
    """What the page compares the baseline with; a removal another page asked for is an intervention."""
    if st.session_state.get(ARRIVING):
        st.session_state["iv_compare"] = "interventions"
    return st.radio("Compare the baseline with", tuple(COMPARE), key="iv_compare", format_func=COMPARE.get, horizontal=True)


# --- another checkpoint: one prompt on two models of one tokenizer --------------------------------------------
def other_checkpoint(om: AppModel, base: Entry) -> None:
    """The prompt on a second checkpoint (e.g. V3.1-Terminus against V3.2-Exp), compared block by block
    with tracing.analyses.diff's tables."""
    st.text_input(
        "Checkpoint directory to compare with",
        key="iv_other_dir",
        placeholder="/data/DeepSeek-V3.1-Terminus, or demo",
        help="A checkpoint with the same tokenizer (the prompt must make the same tokens) and the same number of "
        "blocks, width and vocabulary. Both load in this process: the memory of two models" + paths.roots_help("checkpoints"),
    )
    if st.button("Compare the checkpoints", key="iv_other_run", type="primary", icon=":material/compare_arrows:"):
        st.session_state[OTHER] = {"base": base.key, "dir": st.session_state.get("iv_other_dir") or ""}
    asked = st.session_state.get(OTHER)
    if asked is None:
        st.caption("Type a checkpoint directory and press **Compare the checkpoints**: the prompt runs on both.")
        return
    if asked["base"] != base.key:
        st.info(
            "The prompt or the model changed since the last comparison: press **Compare the checkpoints** again.",
            icon=":material/refresh:",
        )
        return
    try:
        other = runs.open_other(om, asked["dir"])
        with st.spinner(f"Tracing the prompt on {other.label}…"):
            a, b = runs.traced_pair(om, base, other)
        tables, info = runs.pair_diff(a, b)
    except BAD_INPUT as exc:
        st.error(f"**Not compared.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    comparison.show_pair(a, b, tables, info)


def baseline(om: AppModel) -> Entry | None:
    """The plain trace of the prompt the session shows (also when it shows an intervened one), writing
    the same tokens the same way when it generates: the intervened run generates with it."""
    key = st.session_state.get("trace_key")
    if key is None or not key.on(om):
        widgets.no_trace()
        return None
    try:
        with st.spinner("Tracing the baseline…"):
            return runs.baseline(om, key)
    except BAD_INPUT as exc:
        st.error(f"**The baseline could not be traced.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


def uploaded_graph():
    """The intervention graph of the uploader's files, or None (InputError when they do not make one)."""
    files = st.session_state.get("iv_graph") or []
    return runs.read_graph([(f.name, f.getvalue()) for f in files])


def run_now(om: AppModel, base: Entry, cfg) -> None:
    try:
        spec = runs.spec_of(st.session_state, cfg)
        graph = uploaded_graph()
        if not runs.changes(spec) and graph is None:
            st.warning(
                "Nothing to change: choose experts to ablate or zero, heads to ablate, the router without its bias, "
                "another attention, no FP8 activation rounding, or upload an intervention graph."
            )
            return
        n = cfg.n_layers
        with progress.progress(st, "intervene", "Running with the interventions…") as step:
            runs.intervened(om, base, spec, lambda i: step(i / n, f"Block {i} ({i + 1} of {n})…"), graph)
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state[RESULT] = {"base": base.key, "spec": spec, "graph": graph.fingerprint() if graph is not None else None}


def intervened(om: AppModel, base: Entry, spec: dict[str, Any], graph=None) -> Entry | None:
    """The last run's trace, from the store, or run again when the store dropped it."""
    try:
        with st.spinner("Running with the interventions…"):
            return runs.intervened(om, base, spec, graph=graph)
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


if __name__ == "__main__":
    page()
