"""Interventions: change one thing (ablate experts, route without the correction bias, dense attention or
another index_topk), run the prompt again, and compare the two traces side by side: where the residual
stream starts to move, which experts and keys changed, and how the predictions moved.

The session keeps only the widgets' values and the last run's spec (small dicts); the baseline and the
intervened trace live in the process-wide store (app.state), the diff tables and figures in the
intervened entry's memo.
"""

from __future__ import annotations

import hashlib
from typing import Any

import streamlit as st

from app import plots, shaping, state, widgets
from app.views.export import zip_bytes
from tracing.diff import diff_tables, summary
from tracing.errors import InputError
from tracing.interventions import AblateExperts, IndexTopK, Intervention, NoGateBias

ATTENTION = ("model", "dense", "topk")
# widget values kept while the page is not drawn (another page, another block's expert list)
_KEEP = ("iv_block", "iv_ablate_text", "iv_no_bias", "iv_no_bias_blocks", "iv_attention", "iv_topk", "iv_only_changed")
_EXPERTS = "iv_experts_"  # + block: the experts ablated in that block
RESULT = "iv_result"  # {"base": the baseline's store key, "spec": what was run}: enough to run it again
MAX_ROWS = 5_000  # rows of a diff table shown on the page (the CSV has them all)
TABLES = {
    "stream": (
        "Residual stream",
        "Per block, point (in, after attention, out) and position: relative L2 distance and cosine of the streams.",
    ),
    "experts": ("Experts", "Per MoE block and position: the experts each run chose, how many differ, their Jaccard overlap."),
    "indexer_keys": ("Indexer keys", "Per block and query position: the keys the indexer selected in each run."),
    "predictions": ("Logit lens", "Per block and position: the logit lens's top-1 token in each run, with its probability."),
    "next_token": ("Next token", "The top next tokens of either run after the last position, with both probabilities."),
}


# --- the spec: what to run, as plain values ---------------------------------------------------------------
def moe_blocks(cfg) -> list[int]:
    return list(range(cfg.n_dense_layers, cfg.n_layers))


def spec_from_widgets(cfg) -> dict[str, Any]:
    """The interventions the widgets ask for: ``{"ablate": {block: [experts]}, "no_bias": None | "all" |
    [blocks], "attention": None | "dense" | k}``. InputError when the typed ablations do not parse."""
    ablate: dict[int, set[int]] = {}
    for block in moe_blocks(cfg):
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


def build(spec: dict[str, Any]) -> list[Intervention]:
    """tracing.interventions objects for a spec (their checks run when the model runs)."""
    out: list[Intervention] = []
    if spec.get("ablate"):
        out.append(AblateExperts({int(b): tuple(ids) for b, ids in spec["ablate"].items()}))
    if spec.get("no_bias") is not None:
        out.append(NoGateBias(None if spec["no_bias"] == "all" else tuple(spec["no_bias"])))
    if spec.get("attention") == "dense":
        out.append(IndexTopK.dense())
    elif spec.get("attention") is not None:
        out.append(IndexTopK(int(spec["attention"])))
    return out


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


def _show(key) -> None:
    st.session_state["trace_key"] = key


def _keep(cfg) -> None:
    """Carry the widgets' values across pages and block switches, dropping values this config lacks."""
    for key in list(st.session_state):
        if isinstance(key, str) and (key in _KEEP or key.startswith(_EXPERTS)):
            st.session_state[key] = st.session_state[key]
    blocks = moe_blocks(cfg)
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
        state.current(),
    )
    om = state.session_model()
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
        compare(base, iv, result["spec"])


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


def baseline(om: state.OpenModel) -> state.Entry | None:
    """The plain trace of the prompt the session shows (also when it shows an intervened one)."""
    key = st.session_state.get("trace_key")
    if key is None or key[0] != "model" or key[1] != str(om.path) or key[2] != om.dtype:
        widgets.no_trace()
        return None
    entry = state.store().get(key[:4])
    if entry is not None:
        return entry
    try:
        with st.spinner("Tracing the baseline…"):
            return state.trace_prompt(om, key[3])
    except state.BAD_INPUT as exc:
        st.error(f"**The baseline could not be traced.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


def controls(base: state.Entry, cfg) -> None:
    blocks = moe_blocks(cfg)
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


def ablation_controls(base: state.Entry, cfg, blocks: list[int]) -> None:
    block = st.selectbox("MoE block", blocks, key="iv_block", format_func=lambda b: f"block {b}")
    counts = base.memo(("expert_tokens", block), lambda: shaping.expert_tokens(base.trace, block))
    st.multiselect(
        f"Experts never chosen in block {block}",
        list(range(cfg.n_routed_experts)),
        key=f"{_EXPERTS}{block}",
        format_func=(lambda e: f"{e} · {counts[e]} tok") if counts is not None else str,
        placeholder="none",
        help="Masked out of the router's scores before the group and expert top-k: each token goes to its next "
        f"choices. At least k = {cfg.n_activated_experts} experts must remain.",
    )
    busiest = shaping.busiest_experts(base.trace, block, 5)
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


def run_now(om: state.OpenModel, base: state.Entry, cfg) -> None:
    try:
        spec = spec_from_widgets(cfg)
        interventions = build(spec)
        if not interventions:
            st.warning("Nothing to change: choose experts to ablate, the router without its bias, or another attention.")
            return
        bar = st.progress(0.0, text="Running with the interventions…")

        def on_block(i: int) -> None:
            bar.progress(i / cfg.n_layers, text=f"Block {i} ({i + 1} of {cfg.n_layers})…")

        try:
            state.trace_prompt(om, base.key[3], on_block, interventions=interventions)
        finally:
            bar.empty()
    except state.BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state[RESULT] = {"base": base.key, "spec": spec}


def intervened(om: state.OpenModel, base: state.Entry, spec: dict[str, Any]) -> state.Entry | None:
    """The last run's trace, from the store, or run again when the store dropped it."""
    try:
        with st.spinner("Running with the interventions…"):
            return state.trace_prompt(om, base.key[3], interventions=build(spec))
    except state.BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


# --- the comparison --------------------------------------------------------------------------------------------
def compare(base: state.Entry, iv: state.Entry, spec: dict[str, Any]) -> None:
    a, b = base.trace, iv.trace
    try:
        tables = iv.memo(("diff", base.key), lambda: diff_tables(a, b))
    except InputError as exc:
        st.error(f"**Not compared.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    info = iv.memo(("diff_summary", base.key), lambda: summary(a, b, tables))
    st.subheader("Baseline vs intervened", anchor=False)
    st.markdown(
        " ".join(f":red-badge[:material/science: {widgets.escape_md(d)}]" for d in state.describe_interventions(build(spec)))
    )
    summary_metrics(info, tables, a.config.n_layers)

    labels = base.memo("labels", lambda: shaping.position_labels(a))
    left, right = st.columns(2, gap="large")
    for column, entry, title in ((left, base, "Baseline"), (right, iv, "Intervened")):
        with column, st.container(border=True):
            st.markdown(f"**{title}** · {widgets.escape_md(entry.origin)} · traced in {entry.seconds:.2f} s")
            frame = entry.memo("next_tokens", lambda entry=entry: shaping.next_tokens(entry.trace))
            if frame is None:
                widgets.missing("No next-token logits", ["logits.last"])
            else:
                widgets.chart(
                    memo_figure(iv, base, f"next_{title}", lambda frame=frame: plots.next_token(frame)), f"iv_next_{title}"
                )

    st.subheader("Where it changed", anchor=False)
    moved = iv.memo(("drift", base.key), lambda: shaping.drift(tables.get("stream"), a.n_tokens))
    if moved is None:
        widgets.missing("No residual stream drift", ["layers.{i}.resid_pre", "layers.{i}.resid_mid", "layers.{i}.resid_post"])
    else:
        widgets.chart(memo_figure(iv, base, "drift", lambda: plots.drift(moved, labels)), "iv_drift")
    left, right = st.columns(2, gap="large")
    with left:
        per_block = iv.memo(("per_block", base.key), lambda: shaping.changes_per_block(tables, a.config.n_layers))
        widgets.chart(memo_figure(iv, base, "per_block", lambda: plots.block_changes(per_block, a.n_tokens)), "iv_per_block")
    with right:
        load_change(base, iv, spec)
    lens = iv.memo(("lens", base.key), lambda: shaping.lens_changes(tables.get("predictions"), a.n_tokens))
    if lens is None:
        widgets.missing("No logit lens", ["layers.{i}.logit_lens.topk_indices"])
    else:
        widgets.chart(memo_figure(iv, base, "lens", lambda: plots.lens_changes(lens, labels)), "iv_lens")
    change = shaping.next_token_change(tables.get("next_token"))
    if change is not None:
        widgets.chart(memo_figure(iv, base, "next_change", lambda: plots.next_token_change(change)), "iv_next_change")

    diff_downloads(base, iv, tables)


def memo_figure(iv: state.Entry, base: state.Entry, name: str, build):
    return iv.memo(("figure", "interventions", name, base.key), build)


def summary_metrics(info: dict, tables: dict, n_layers: int) -> None:
    cols = st.columns(5)
    first = info.get("first_layer_changed")
    cols[0].metric(
        "First block that changed",
        "none" if first is None else f"block {first}",
        help="The first block whose residual stream (in, after attention or out) differs at any position",
    )
    for col, name, label in ((cols[1], "experts", "Expert choices changed"), (cols[2], "indexer_keys", "Key sets changed")):
        frame = tables.get(name)
        if frame is None:
            col.metric(label, "—")
        else:
            col.metric(
                label,
                f"{int(frame['changed'].sum())} of {len(frame)}",
                help="(block, position) pairs whose selected set differs between the runs",
            )
    kl = info.get("next_token_kl")
    cols[3].metric(
        "Next-token KL",
        "—" if kl is None else f"{kl:.4g} nats",
        help="KL(baseline ‖ intervened) of the next-token distribution after the last position",
    )
    frame = tables.get("next_token")
    if frame is not None and "next_token_a" in info:
        names = dict(zip(frame["token_id"], frame["token"], strict=True))
        before = shaping.show_token(str(names.get(info["next_token_a"], f"<{info['next_token_a']}>")), html_escape=False)
        after = shaping.show_token(str(names.get(info["next_token_b"], f"<{info['next_token_b']}>")), html_escape=False)
        cols[4].metric("Top next token", f"{before} → {after}" if before != after else f"{before} (same)")
    drift = info.get("max_rel_l2_per_layer")
    if drift:
        st.caption(
            f"Largest relative L2 drift of the stream per block: {', '.join(f'{v:.3g}' for v in drift)} "
            f"(blocks 0–{n_layers - 1})."
        )


def load_change(base: state.Entry, iv: state.Entry, spec: dict[str, Any]) -> None:
    blocks = shaping.moe_blocks(base.trace)
    if not blocks:
        st.caption("No MoE blocks in this trace: no expert load to compare.")
        return
    ablated = {int(b): tuple(ids) for b, ids in (spec.get("ablate") or {}).items()}
    options = blocks
    if st.session_state.get("iv_load_block") not in options:
        st.session_state["iv_load_block"] = next(iter(ablated), blocks[0])
    block = st.selectbox("Expert load of", options, key="iv_load_block", format_func=lambda b: f"block {b}")
    before = shaping.expert_tokens(base.trace, block)
    after = shaping.expert_tokens(iv.trace, block)
    if before is None or after is None:
        widgets.missing("No routing", ["layers.{i}.ffn.gate.topk_indices"], block)
        return
    cfg = base.trace.config
    fig = memo_figure(
        iv,
        base,
        ("load", block),
        lambda: plots.expert_load_change(before, after, ablated.get(block, ()), block, cfg.experts_per_group),
    )
    widgets.chart(fig, "iv_load")


def diff_downloads(base: state.Entry, iv: state.Entry, tables: dict) -> None:
    st.subheader("Diff tables", anchor=False)
    stem = "diff-" + hashlib.sha256(repr(iv.key).encode()).hexdigest()[:8]
    cols = st.columns(3)
    cols[0].download_button(
        "All diff tables (CSV, zip)",
        data=lambda: zip_bytes(tables),
        file_name=f"{stem}-tables.zip",
        mime="application/zip",
        icon=":material/folder_zip:",
        key="iv_dl_zip",
        on_click="ignore",
        width="stretch",
    )
    cols[1].download_button(
        "Intervened trace (.safetensors)",
        data=iv.trace_bytes,
        file_name=f"{stem}-intervened.safetensors",
        mime="application/octet-stream",
        icon=":material/save:",
        key="iv_dl_trace",
        on_click="ignore",
        width="stretch",
        help="Open it here (source: Trace file) or compare with `python -m tracing diff`",
    )
    if st.session_state.get("trace_key") == iv.key:
        cols[2].button(
            "Show the baseline in the other pages",
            key="iv_show_base",
            on_click=_show,
            args=(base.key,),
            icon=":material/undo:",
            width="stretch",
        )
    else:
        cols[2].button(
            "Show the intervened trace in the other pages",
            key="iv_show",
            on_click=_show,
            args=(iv.key,),
            icon=":material/visibility:",
            width="stretch",
            help="The residual, attention and router pages then draw the intervened run",
        )
    only = st.toggle("Only rows that changed", key="iv_only_changed")
    names = [name for name in TABLES if name in tables]
    for tab, name in zip(st.tabs([TABLES[n][0] for n in names]), names, strict=True):
        with tab:
            frame = tables[name]
            head, button = st.columns([5, 1], vertical_alignment="center")
            head.caption(f"{TABLES[name][1]} {len(frame):,} rows; the CSV holds them all.")
            widgets.csv_button(button, frame, f"{stem}-{name}.csv", f"iv_dl_csv_{name}")
            shown = changed_rows(frame, name) if only else frame
            if len(shown) > MAX_ROWS:
                st.caption(f"The first {MAX_ROWS:,} of {len(shown):,} rows:")
            st.dataframe(shown.head(MAX_ROWS), hide_index=True, width="stretch")


def changed_rows(frame, name: str):
    if name == "stream":
        return frame[frame["rel_l2"] > 0]
    if "changed" in frame:
        return frame[frame["changed"]]
    return frame


if __name__ == "__main__":
    page()
