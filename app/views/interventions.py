"""Interventions: change one thing (ablate experts, route without the correction bias, dense attention or
another index_topk), run the prompt again, and compare the two traces side by side: where the residual
stream starts to move, which experts and keys changed, and how the predictions moved.

The session keeps only the widgets' values and the last run's spec (small dicts, read by
tracing.interventions.from_spec); the baseline and the intervened trace live in the process-wide
store (app.core.traces), the diff tables and figures in the intervened entry's memo.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from app import comparison, widgets
from app.core.errors import BAD_INPUT
from app.core.models import OpenModel
from app.core.session import current, session_model
from app.core.traces import Entry, store, trace_prompt
from app.topics import experts
from app.topics.interventions import moe_block_ids
from tracing.interventions import AblateExperts, from_spec

ATTENTION = ("model", "dense", "topk")
# widget values kept while the page is not drawn (another page, another block's expert list)
_KEEP = ("iv_block", "iv_ablate_text", "iv_no_bias", "iv_no_bias_blocks", "iv_attention", "iv_topk", "iv_only_changed")
_EXPERTS = "iv_experts_"  # + block: the experts ablated in that block
RESULT = "iv_result"  # {"base": the baseline's store key, "spec": what was run}: enough to run it again


# --- the spec: what to run, as plain values ---------------------------------------------------------------
def spec_from_widgets(cfg) -> dict[str, Any]:
    """The interventions the widgets ask for: ``{"ablate": {block: [experts]}, "no_bias": None | "all" |
    [blocks], "attention": None | "dense" | k}``. InputError when the typed ablations do not parse."""
    ablate: dict[int, set[int]] = {}
    for block in moe_block_ids(cfg):
        picked = st.session_state.get(f"{_EXPERTS}{block}") or []
        if picked:
            ablate.setdefault(block, set()).update(int(e) for e in picked)
    text = (st.session_state.get("iv_ablate_text") or "").strip()
    if text:
        for block, ids in AblateExperts.parse(text).experts.items():
            ablate.setdefault(block, set()).update(ids)
    no_bias = None
    if st.session_state.get("iv_no_bias") and cfg.has_gate_bias:
        chosen = st.session_state.get("iv_no_bias_blocks") or []
        no_bias = sorted(int(b) for b in chosen) if chosen else "all"
    mode = st.session_state.get("iv_attention", "model")
    attention = "dense" if mode == "dense" else int(st.session_state.get("iv_topk") or 1) if mode == "topk" else None
    return {"ablate": {b: sorted(ids) for b, ids in sorted(ablate.items())}, "no_bias": no_bias, "attention": attention}


# --- callbacks (run before the page is drawn again) ------------------------------------------------------------
def _add_expert(block: int, expert: int) -> None:
    key = f"{_EXPERTS}{block}"
    st.session_state[key] = sorted({*(st.session_state.get(key) or []), expert})


def _clear() -> None:
    for key in list(st.session_state):
        if isinstance(key, str) and key.startswith(_EXPERTS):
            st.session_state[key] = []
    st.session_state["iv_ablate_text"] = ""
    st.session_state["iv_no_bias"] = False
    st.session_state["iv_no_bias_blocks"] = []
    st.session_state["iv_attention"] = "model"


def _keep(cfg) -> None:
    """Carry the widgets' values across pages and block switches, dropping values this config lacks."""
    for key in list(st.session_state):
        if isinstance(key, str) and (key in _KEEP or key.startswith(_EXPERTS)):
            st.session_state[key] = st.session_state[key]
    blocks = moe_block_ids(cfg)
    for key in [k for k in st.session_state if isinstance(k, str) and k.startswith(_EXPERTS)]:
        block = key.removeprefix(_EXPERTS)
        if not block.isdigit() or int(block) not in blocks:
            del st.session_state[key]
        else:
            st.session_state[key] = [e for e in st.session_state[key] if 0 <= e < cfg.n_routed_experts]
    if st.session_state.get("iv_block") not in blocks:
        chosen = st.session_state.get("block", 0)
        st.session_state["iv_block"] = chosen if chosen in blocks else (blocks[0] if blocks else None)
    st.session_state["iv_no_bias_blocks"] = [b for b in st.session_state.get("iv_no_bias_blocks", []) if b in blocks]
    st.session_state.setdefault("iv_no_bias", False)
    st.session_state.setdefault("iv_attention", "model")
    st.session_state.setdefault("iv_topk", max(1, cfg.index_topk // 2))
    st.session_state["iv_topk"] = min(max(1, int(st.session_state["iv_topk"])), cfg.max_seq_len)
    st.session_state.setdefault("iv_only_changed", True)


# --- the page --------------------------------------------------------------------------------------------------
def page() -> None:
    widgets.page_header(
        "Interventions",
        "Change one thing and watch what moves: ablate experts (the router goes around them), route without the "
        "correction bias, or attend to every key (or another number of them). The prompt runs again and the two "
        "traces are compared block by block.",
        current(),
    )
    om = session_model()
    if om is None:
        no_model()
        return
    base = baseline(om)
    if base is None:
        return
    cfg = om.args
    _keep(cfg)
    controls(base, cfg)
    run = st.button("Run with these interventions", type="primary", key="iv_run", icon=":material/play_arrow:")
    if run:
        run_now(om, base, cfg)
    result = st.session_state.get(RESULT)
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
    iv = intervened(om, base, result["spec"])
    if iv is not None:
        comparison.compare(base, iv, result["spec"])


def no_model() -> None:
    if st.session_state.get("source") == "upload":
        st.info(
            "Interventions run the model again, and a trace file holds no model. Choose **Bundled demo** or a "
            "**Checkpoint directory** in the sidebar to run one; two trace files of one prompt compare on the "
            "command line: `python -m tracing diff A.safetensors B.safetensors --csv DIR`.",
            icon=":material/info:",
        )
    else:
        st.info(
            "Interventions run the model again: load a checkpoint in the sidebar (the bundled demo or a "
            "checkpoint directory) first.",
            icon=":material/arrow_back:",
        )


def baseline(om: OpenModel) -> Entry | None:
    """The plain trace of the prompt the session shows (also when it shows an intervened one), writing
    the same tokens the same way when it generates: the intervened run generates with it."""
    key = st.session_state.get("trace_key")
    if key is None or not key.on(om):
        widgets.no_trace()
        return None
    entry = store().get(key.plain)
    if entry is not None:
        return entry
    try:
        with st.spinner("Tracing the baseline…"):
            return trace_prompt(om, key.prompt, generation=key.generation)
    except BAD_INPUT as exc:
        st.error(f"**The baseline could not be traced.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


def controls(base: Entry, cfg) -> None:
    blocks = moe_block_ids(cfg)
    with st.container(border=True):
        experts_col, router_col, attention_col = st.columns(3, gap="large")
        with experts_col:
            st.markdown("**Ablate experts**")
            if not blocks:
                st.caption("This model has no MoE blocks.")
            else:
                ablation_controls(base, cfg, blocks)
        with router_col:
            st.markdown("**Router**")
            st.toggle(
                "Route without the correction bias",
                key="iv_no_bias",
                disabled=not blocks or not cfg.has_gate_bias,
                help="Choose experts by the unbiased scores s, groups by their best expert, as the reference router "
                "without a bias. The weights come from s either way.",
            )
            st.multiselect(
                "In blocks",
                blocks,
                key="iv_no_bias_blocks",
                format_func=lambda b: f"block {b}",
                placeholder="every MoE block",
                disabled=not st.session_state.get("iv_no_bias") or not cfg.has_gate_bias,
            )
            if blocks and not cfg.has_gate_bias:
                st.caption("This checkpoint's router has no correction bias: there is nothing to remove.")
        with attention_col:
            st.markdown("**Sparse attention**")
            st.radio(
                "Keys each query may attend to",
                ATTENTION,
                key="iv_attention",
                format_func=lambda m: {
                    "model": f"as the model: the indexer's top {cfg.index_topk}",
                    "dense": "dense: every visible key",
                    "topk": "another index_topk",
                }[m],
            )
            st.number_input(
                "index_topk",
                min_value=1,
                max_value=cfg.max_seq_len,
                step=1,
                key="iv_topk",
                disabled=st.session_state.get("iv_attention") != "topk",
                help=f"The model's is {cfg.index_topk}; with {base.trace.n_tokens} tokens, {base.trace.n_tokens} or "
                "more is dense attention.",
            )
        st.button("Clear all", key="iv_clear", on_click=_clear, icon=":material/restart_alt:")


def ablation_controls(base: Entry, cfg, blocks: list[int]) -> None:
    block = st.selectbox("MoE block", blocks, key="iv_block", format_func=lambda b: f"block {b}")
    counts = base.memo(("expert_tokens", block), lambda: experts.expert_tokens(base.trace, block))
    st.multiselect(
        f"Experts never chosen in block {block}",
        list(range(cfg.n_routed_experts)),
        key=f"{_EXPERTS}{block}",
        format_func=(lambda e: f"{e} · {counts[e]} tok") if counts is not None else str,
        placeholder="none",
        help="Masked out of the router's scores before the group and expert top-k: each token goes to its next "
        f"choices. At least k = {cfg.n_activated_experts} experts must remain.",
    )
    busiest = experts.busiest_experts(base.trace, block, 5)
    if busiest:
        st.caption(
            f"Busiest in block {block} (baseline, tokens of {base.trace.n_tokens}): "
            + " · ".join(f"{e} ({n})" for e, n in busiest)
        )
        left = [e for e, _ in busiest if e not in (st.session_state.get(f"{_EXPERTS}{block}") or [])]
        if left:
            st.button(
                f"Add expert {left[0]}, the busiest not picked",
                key="iv_add_busiest",
                on_click=_add_expert,
                args=(block, left[0]),
                icon=":material/add:",
            )
    st.text_input(
        "More, typed as LAYER:EXPERT,…",
        key="iv_ablate_text",
        placeholder="e.g. 1:3,2:7",
        help="The command line's --ablate-experts syntax; added to the picks above.",
    )
    chosen = {b: st.session_state.get(f"{_EXPERTS}{b}") for b in blocks}
    picked = "; ".join(f"block {b}: {', '.join(map(str, sorted(ids)))}" for b, ids in chosen.items() if ids)
    if picked:
        st.caption(f"Picked: {picked}")


def run_now(om: OpenModel, base: Entry, cfg) -> None:
    try:
        spec = spec_from_widgets(cfg)
        changes = from_spec(spec)
        if not changes:
            st.warning("Nothing to change: choose experts to ablate, the router without its bias, or another attention.")
            return
        bar = st.progress(0.0, text="Running with the interventions…")

        def on_block(i: int) -> None:
            bar.progress(i / cfg.n_layers, text=f"Block {i} ({i + 1} of {cfg.n_layers})…")

        try:
            trace_prompt(om, base.key.prompt, on_block, interventions=changes, generation=base.key.generation)
        finally:
            bar.empty()
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state[RESULT] = {"base": base.key, "spec": spec}


def intervened(om: OpenModel, base: Entry, spec: dict[str, Any]) -> Entry | None:
    """The last run's trace, from the store, or run again when the store dropped it."""
    try:
        with st.spinner("Running with the interventions…"):
            return trace_prompt(om, base.key.prompt, interventions=from_spec(spec), generation=base.key.generation)
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


if __name__ == "__main__":
    page()
