"""Interventions: change one thing (ablate experts, zero their outputs, ablate attention heads, route
without the correction bias, dense attention or another index_topk), run the prompt again, and
compare the two traces side by side: where the residual stream starts to move, which experts and
keys changed, and how the predictions moved. Or run the prompt on another checkpoint of the same
tokenizer (V3.1-Terminus against V3.2-Exp) and compare the two models block by block.

The session keeps only the widgets' values and the last run's spec (small dicts, read by
tracing.analyses.interventions.from_spec); the baseline and the intervened trace live in the process-wide
store (app.core.traces), the diff tables and figures in the intervened entry's memo.
"""

from __future__ import annotations

from typing import Any

import streamlit as st

from app import comparison, widgets
from app.core import paths
from app.core.errors import BAD_INPUT
from app.core.models import AppModel, open_model
from app.core.session import current, session_model
from app.core.traces import Entry, request_for, store, trace_prompt
from app.topics import experts, interventions
from app.topics.export import ZIP, zip_bytes
from app.topics.interventions import ABLATE, ARRIVING, HEADS, PER_BLOCK, TABLES, ZERO, PerBlock, listing, moe_block_ids
from tracing.analyses.diff import check_shapes, check_tokenizers, diff_tables, summary
from tracing.analyses.intervention_specs import from_spec

ATTENTION = ("model", "dense", "topk")
RESULT = "iv_result"  # {"base": the baseline's store key, "spec": what was run}: enough to run it again
COMPARE = {"interventions": "interventions on this checkpoint", "checkpoint": "another checkpoint"}
OTHER = "iv_other_result"  # {"base": the baseline's store key, "dir": the other checkpoint as typed}
PAIR_SITES = ("default", "logits.all", "layers.*.logit_lens.*")  # both checkpoints record these (the per-position KL)
PAIR = "checkpoint diff"  # the store's variant of a trace made for the comparison


# --- the spec: what to run, as plain values ---------------------------------------------------------------
def spec_from_widgets(cfg) -> dict[str, Any]:
    """The interventions the widgets ask for: ``{"ablate" | "zero_experts" | "ablate_heads": {block: [ids]},
    "no_bias": None | "all" | [blocks], "attention": None | "dense" | k, "no_act_fp8": bool, "at": None | "P" |
    "A:B"}`` (the positions the removals act at). InputError when typed ids do not parse."""
    spec: dict[str, Any] = {kind.spec_key: kind.picked(st.session_state, cfg) for kind in PER_BLOCK}
    no_bias = None
    if st.session_state.get("iv_no_bias") and cfg.has_gate_bias:
        chosen = st.session_state.get("iv_no_bias_blocks") or []
        no_bias = sorted(int(b) for b in chosen) if chosen else "all"
    mode = st.session_state.get("iv_attention", "model") if cfg.has_indexer else "model"
    attention = "dense" if mode == "dense" else int(st.session_state.get("iv_topk") or 1) if mode == "topk" else None
    at = (st.session_state.get("iv_at") or "").strip()
    no_act_fp8 = bool(st.session_state.get("iv_no_act_fp8")) and cfg.dtype == "fp8" and cfg.has_indexer
    return {**spec, "no_bias": no_bias, "attention": attention, "no_act_fp8": no_act_fp8, "at": at or None}


# --- callbacks (run before the page is drawn again) ------------------------------------------------------------
def _add_expert(key: str, expert: int) -> None:
    st.session_state[key] = sorted({*(st.session_state.get(key) or []), expert})


def _clear() -> None:
    for kind in PER_BLOCK:
        for key in [k for k in st.session_state if kind.block_of(k) is not None]:
            st.session_state[key] = []
        st.session_state[kind.text_key] = ""
    st.session_state["iv_no_bias"] = False
    st.session_state["iv_no_bias_blocks"] = []
    st.session_state["iv_attention"] = "model"
    st.session_state["iv_no_act_fp8"] = False
    st.session_state["iv_at"] = ""


def _keep(cfg) -> None:
    """Carry the per-block picks across block switches (the page's other widgets are kept by the
    session's schema), dropping values this config lacks."""
    for kind in PER_BLOCK:
        _keep_picks(kind, cfg)
    blocks = moe_block_ids(cfg)
    st.session_state["iv_no_bias_blocks"] = [b for b in st.session_state.get("iv_no_bias_blocks", []) if b in blocks]
    st.session_state.setdefault("iv_no_bias", False)
    st.session_state.setdefault("iv_attention", "model")
    st.session_state.setdefault("iv_topk", max(1, cfg.index_topk // 2))
    st.session_state["iv_topk"] = min(max(1, int(st.session_state["iv_topk"])), cfg.max_seq_len)
    st.session_state.setdefault("iv_only_changed", True)
    st.session_state.setdefault("iv_at", "")


def _keep_picks(kind: PerBlock, cfg) -> None:
    blocks, ids = kind.blocks(cfg), kind.ids(cfg)
    for key in [k for k in st.session_state if kind.block_of(k) is not None]:
        if kind.block_of(key) not in blocks:
            del st.session_state[key]
        else:
            st.session_state[key] = [i for i in st.session_state[key] if i in ids]
    if kind.text_key in st.session_state:
        st.session_state[kind.text_key] = st.session_state[kind.text_key]
    block = st.session_state.get(kind.block_key)
    if block not in blocks:
        chosen = st.session_state.get("block", 0)
        block = chosen if chosen in blocks else (blocks[0] if blocks else None)
    st.session_state[kind.block_key] = block


def _arrive() -> bool:
    """Take a removal another page asked for (app.topics.interventions.ask_to_remove): it alone is picked.
    True when there was one, to run it now."""
    asked = st.session_state.pop(ARRIVING, None)
    if not asked:
        return False
    _clear()
    for kind in PER_BLOCK:
        for block, ids in (asked.get(kind.spec_key) or {}).items():
            st.session_state[f"{kind.prefix}{block}"] = list(ids)
            st.session_state[kind.block_key] = block
    st.session_state["iv_at"] = asked.get("at") or ""
    return True


# --- the page --------------------------------------------------------------------------------------------------
def page() -> None:
    widgets.page_header(
        "Interventions",
        "Change one thing and watch what moves: ablate experts (the router goes around them), zero experts' outputs "
        "(still chosen, writing nothing), ablate attention heads, route without the correction bias, or attend to "
        "every key (or another number of them). The prompt runs again and the two traces are compared block by block; "
        "removing the head or expert with the largest part on the Attribution page is its causal check.",
        current(),
    )
    om = session_model()
    if om is None:
        no_model()
        return
    base = baseline(om)
    if base is None:
        return
    if compare_mode() == "checkpoint":
        other_checkpoint(om, base)
        return
    cfg = om.args
    arrived = _arrive()
    _keep(cfg)
    controls(base, cfg)
    run = st.button("Run with these interventions", type="primary", key="iv_run", icon=":material/play_arrow:")
    if run or arrived:
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
        a, b = traced_pair(om, base, asked["dir"])
        tables = b.memo(("checkpoint_diff", a.key), lambda: diff_tables(a.trace, b.trace))
    except BAD_INPUT as exc:
        st.error(f"**Not compared.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    show_pair(a, b, tables)


def traced_pair(om: AppModel, base: Entry, value: str) -> tuple[Entry, Entry]:
    """The baseline's prompt (without its generation) on this model and on the one ``value`` names,
    recording :data:`PAIR_SITES`; refused (the error says why) when the checkpoint does not open (confined
    under the roots: app.core.paths), the shapes differ, or the tokenizers make other tokens of the prompt."""
    key = base.key
    other = open_model(value, om.dtype)
    check_shapes(om.args, other.args, "the checkpoints are models")
    a = trace_prompt(om, key.prompt, variant=PAIR, record=PAIR_SITES, chat=key.chat)
    check_tokenizers(a.trace.token_ids, other.encode(request_for(other, key.prompt, chat=key.chat)))  # before it runs
    with st.spinner(f"Tracing the prompt on {other.label}…"):
        b = trace_prompt(other, key.prompt, variant=PAIR, record=PAIR_SITES, chat=key.chat)
    check_tokenizers(a.trace.token_ids, b.trace.token_ids, pieces_a=a.trace.tokens, pieces_b=b.trace.tokens)
    return a, b


def show_pair(a: Entry, b: Entry, tables: dict) -> None:
    info = b.memo(("checkpoint_summary", a.key), lambda: summary(a.trace, b.trace, tables))
    names = (a.origin.split(" · ")[0], b.origin.split(" · ")[0])
    st.subheader(f"{widgets.escape_md(names[0])} vs {widgets.escape_md(names[1])}", anchor=False)
    st.caption(
        f"The prompt alone ({a.trace.n_tokens} tokens, no generation), the same tokens on both; a is "
        f"{widgets.escape_md(a.origin)}, b is {widgets.escape_md(b.origin)}."
    )
    cols = st.columns(4)
    kl, agree, first = info.get("kl_mean"), info.get("top1_agreement"), info.get("first_block_changed")
    cols[0].metric(
        "Next-token KL, mean",
        "—" if kl is None else f"{kl:.4g} nats",
        help="KL(p_a ‖ p_b) of the next-token distributions, mean over positions",
    )
    cols[1].metric(
        "Top-1 agreement", "—" if agree is None else f"{agree:.0%}", help="Positions where both predict the same token"
    )
    cols[2].metric("First block that differs", "none" if first is None else f"block {first}")
    if tables.get("next_token") is not None:
        comparison.next_token_metric(cols[3], info, tables)
    blocks = tables.get("blocks")
    if blocks is not None:
        fig = b.memo(("figure", "checkpoint_blocks", a.key), lambda: interventions.checkpoint_blocks_figure(blocks, names))
        widgets.chart(fig, "iv_other_blocks")
    stem = f"checkpoint-diff-{a.key.fingerprint()}-{b.key.fingerprint()}"
    widgets.download(
        st,
        "All diff tables (CSV, zip)",
        lambda: zip_bytes(tables),
        f"{stem}-tables.zip",
        ZIP,
        "iv_other_zip",
        ":material/folder_zip:",
    )
    names_shown = [name for name in ("blocks", *(n for n in TABLES if n != "blocks")) if name in tables]  # per block first
    for tab, name in zip(st.tabs([TABLES[n][0] for n in names_shown]), names_shown, strict=True):
        with tab:
            head, button = st.columns([5, 1], vertical_alignment="center")
            head.caption(f"{TABLES[name][1]} {len(tables[name]):,} rows; the CSV holds them all.")
            widgets.csv_button(button, tables[name], f"{stem}-{name}.csv", f"iv_other_csv_{name}")
            st.dataframe(tables[name].head(comparison.MAX_ROWS), hide_index=True, width="stretch")


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


def baseline(om: AppModel) -> Entry | None:
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
            return trace_prompt(om, key.prompt, generation=key.generation, chat=key.chat)
    except BAD_INPUT as exc:
        st.error(f"**The baseline could not be traced.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


def controls(base: Entry, cfg) -> None:
    blocks = moe_block_ids(cfg)
    with st.container(border=True):
        ablate_col, zero_col, heads_col = st.columns(3, gap="large")
        for column, title, kind, draw in (
            (ablate_col, "Ablate experts", ABLATE, ablation_controls),
            (zero_col, "Zero experts", ZERO, zero_controls),
            (heads_col, "Ablate heads", HEADS, head_controls),
        ):
            with column:
                st.markdown(f"**{title}**")
                if kind.blocks(cfg):
                    draw(base, cfg)
                    typed(kind, cfg)
                else:
                    st.caption("This model has no MoE blocks.")
        router_col, attention_col, clear_col = st.columns(3, gap="large")
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
                disabled=not cfg.has_indexer,
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
                disabled=st.session_state.get("iv_attention") != "topk" or not cfg.has_indexer,
                help=f"The model's is {cfg.index_topk}; with {base.trace.n_tokens} tokens, {base.trace.n_tokens} or "
                "more is dense attention.",
            )
            if not cfg.has_indexer:
                widgets.no_indexer()
            st.toggle(
                "No FP8 activation rounding",
                key="iv_no_act_fp8",
                disabled=cfg.dtype != "fp8" or not cfg.has_indexer,
                help="Every FP8 product takes its input unrounded (the weights stay FP8, dequantised to the activation "
                "dtype), the indexer scores bfloat16 q and k, the MLA latent skips its FP8 simulation: which routing and "
                "key selections the reference's activation rounding decides.",
            )
        with clear_col:
            st.markdown("**Where**")
            st.text_input(
                "Remove experts and heads at positions",
                key="iv_at",
                placeholder=f"every position (or P, A:B of 0..{base.trace.n_tokens - 1})",
                help="P: that position only; A:B: positions A..B-1; A: from A on. Earlier positions stay bit-identical "
                "to the baseline. An attribution's causal check removes a part at the attributed position only. "
                "The command line's LAYER:ID@P.",
            )
            st.button("Clear all", key="iv_clear", on_click=_clear, icon=":material/restart_alt:")


def block_picker(kind: PerBlock, cfg, label: str) -> int:
    return st.selectbox(label, kind.blocks(cfg), key=kind.block_key, format_func=lambda b: f"block {b}")


def expert_picker(base: Entry, cfg, kind: PerBlock, label: str, help: str) -> None:
    """A MoE block, its experts (each with the tokens routed to it in the baseline), and the busiest one to add."""
    block = block_picker(kind, cfg, "MoE block")
    key = f"{kind.prefix}{block}"
    counts = base.memo(("expert_tokens", block), lambda: experts.expert_tokens(base.trace, block))
    st.multiselect(
        label.format(block=block),
        kind.ids(cfg),
        key=key,
        format_func=(lambda e: f"{e} · {counts[e]} tok") if counts is not None else str,
        placeholder="none",
        help=help,
    )
    busiest = experts.busiest_experts(base.trace, block, 5)
    if not busiest:
        return
    st.caption(
        f"Busiest in block {block} (baseline, tokens of {base.trace.n_tokens}): " + " · ".join(f"{e} ({n})" for e, n in busiest)
    )
    left = [e for e, _ in busiest if e not in (st.session_state.get(key) or [])]
    if left:
        st.button(
            f"Add expert {left[0]}, the busiest not picked",
            key=f"iv_add_busiest_{kind.spec_key}",
            on_click=_add_expert,
            args=(key, left[0]),
            icon=":material/add:",
        )


def ablation_controls(base: Entry, cfg) -> None:
    expert_picker(
        base,
        cfg,
        ABLATE,
        "Experts never chosen in block {block}",
        "Masked out of the router's scores before the group and expert top-k: each token goes to its next choices "
        f"(the routing changes). At least k = {cfg.n_activated_experts} experts must remain.",
    )


def zero_controls(base: Entry, cfg) -> None:
    expert_picker(
        base,
        cfg,
        ZERO,
        "Experts writing nothing in block {block}",
        "Still chosen, with the same gate weights, but their weighted output is zeroed before the routed sum: the "
        "routing stays as it was and only what these experts write is removed. Unlike Ablate experts, which routes "
        "each token to its next choice. The causal check of an expert's attribution.",
    )


def head_controls(base: Entry, cfg) -> None:
    block = block_picker(HEADS, cfg, "Block")
    st.multiselect(
        f"Heads of block {block} whose output is zero",
        HEADS.ids(cfg),
        key=f"{HEADS.prefix}{block}",
        format_func=lambda h: f"{block}:{h}",
        placeholder="none",
        help="The head's attention probabilities are zeroed, so it reads no value and its output before wo is zero; "
        "the block's other heads and its indexer's keys stay as they were, while its FFN (routing included) and the "
        "later blocks read the changed stream. The causal check of a head's attribution. Shown as LAYER:HEAD, like "
        "--ablate-heads.",
    )


def typed(kind: PerBlock, cfg) -> None:
    """The command line's LAYER:ID,... text, added to the picks, and every block's picks as that flag writes them."""
    st.text_input(
        f"More, typed as LAYER:{kind.what},…",
        key=kind.text_key,
        placeholder="e.g. 1:3,2:0",
        help=f"The command line's {kind.flag} syntax; added to the picks above.",
    )
    picked = {b: st.session_state.get(f"{kind.prefix}{b}") for b in kind.blocks(cfg)}
    shown = listing({b: sorted(ids) for b, ids in picked.items() if ids})
    if shown:
        st.caption(f"Picked: `{kind.flag} {shown}`")


def run_now(om: AppModel, base: Entry, cfg) -> None:
    try:
        spec = spec_from_widgets(cfg)
        changes = from_spec(spec)
        if not changes:
            st.warning(
                "Nothing to change: choose experts to ablate or zero, heads to ablate, the router without its bias, "
                "another attention, or no FP8 activation rounding."
            )
            return
        bar = st.progress(0.0, text="Running with the interventions…")

        def on_block(i: int) -> None:
            bar.progress(i / cfg.n_layers, text=f"Block {i} ({i + 1} of {cfg.n_layers})…")

        try:
            trace_prompt(om, base.key.prompt, on_block, interventions=spec, generation=base.key.generation, chat=base.key.chat)
        finally:
            bar.empty()
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.session_state[RESULT] = {"base": base.key, "spec": spec}


def intervened(om: AppModel, base: Entry, spec: dict[str, Any]) -> Entry | None:
    """The last run's trace, from the store, or run again when the store dropped it."""
    try:
        with st.spinner("Running with the interventions…"):
            return trace_prompt(om, base.key.prompt, interventions=spec, generation=base.key.generation, chat=base.key.chat)
    except BAD_INPUT as exc:
        st.error(f"**Not run.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return None


if __name__ == "__main__":
    page()
