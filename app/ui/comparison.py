"""Two runs of one prompt compared, for the interventions page: what changed (summary metrics),
both runs' next tokens, where the residual stream moved, per-block changes, expert load, the logit
lens, and the diff tables (tracing.analyses.diff) with their downloads; and one prompt on two
checkpoints, block by block (show_pair)."""

from __future__ import annotations

from typing import Any

import streamlit as st

from app.core.session import origin
from app.core.traces import Entry, describe_interventions
from app.topics import experts, generation, intervention_runs, interventions, predictions, router, tokens
from app.topics.export import OCTETS, ZIP, zip_bytes
from app.topics.interventions import TABLES, changed_rows
from app.ui import widgets
from tracing.analyses.intervention_specs import from_spec
from tracing.errors import InputError

MAX_ROWS = 5_000  # rows of a diff table shown on the page (the CSV has them all)


def _show(key) -> None:
    st.session_state["trace_key"] = key


def compare(base: Entry, iv: Entry, spec: dict[str, Any]) -> None:
    a, b = base.trace, iv.trace
    if not texts_part(base, iv):
        return
    try:
        tables, info = intervention_runs.diff(base, iv)
    except InputError as exc:
        st.error(f"**Not compared.** {widgets.escape_md(str(exc))}", icon=":material/error:")
        return
    st.subheader("Baseline vs intervened", anchor=False)
    st.markdown(
        " ".join(
            f":red-badge[:material/science: {widgets.escape_md(d)}]"
            for d in b.extra.get("interventions") or describe_interventions(from_spec(spec))
        )
    )
    summary_metrics(info, tables, a.config.n_layers, iv.memo(("logit_move", base.key), lambda: interventions.logit_move(a, b)))

    labels = tokens.labels(base)
    left, right = st.columns(2, gap="large")
    for column, entry, title in ((left, base, "Baseline"), (right, iv, "Intervened")):
        with column, st.container(border=True):
            st.markdown(f"**{title}** · {widgets.escape_md(origin(entry))} · traced in {entry.seconds:.2f} s")
            frame = entry.memo("next_tokens", lambda entry=entry: predictions.next_tokens(entry.trace))
            if frame is None:
                widgets.missing("No next-token logits", ["logits.last"])
            else:
                widgets.chart(
                    memo_figure(iv, base, f"next_{title}", lambda frame=frame: predictions.next_token_figure(frame)),
                    f"iv_next_{title}",
                )

    st.subheader("Where it changed", anchor=False)
    moved = iv.memo(("drift", base.key), lambda: interventions.drift(tables.get("stream"), a.n_tokens))
    if moved is None:
        widgets.missing("No residual stream drift", ["layers.{i}.resid_pre", "layers.{i}.resid_mid", "layers.{i}.resid_post"])
    else:
        widgets.chart(memo_figure(iv, base, "drift", lambda: interventions.drift_figure(moved, labels)), "iv_drift")
    left, right = st.columns(2, gap="large")
    with left:
        per_block = iv.memo(("per_block", base.key), lambda: interventions.changes_per_block(tables, a.config.n_layers))
        widgets.chart(
            memo_figure(iv, base, "per_block", lambda: interventions.block_changes_figure(per_block, a.n_tokens)), "iv_per_block"
        )
    with right:
        load_change(base, iv, spec)
    lens = iv.memo(("lens", base.key), lambda: interventions.lens_changes(tables.get("predictions"), a.n_tokens))
    if lens is None:
        widgets.missing("No logit lens", ["layers.{i}.logit_lens.topk_indices"])
    else:
        widgets.chart(memo_figure(iv, base, "lens", lambda: interventions.lens_changes_figure(lens, labels)), "iv_lens")
    change = interventions.next_token_change(tables.get("next_token"))
    if change is not None:
        widgets.chart(
            memo_figure(iv, base, "next_change", lambda: interventions.next_token_change_figure(change)), "iv_next_change"
        )

    diff_downloads(base, iv, tables)


def texts_part(base: Entry, iv: Entry) -> bool:
    """For generated runs, the two texts side by side and where they part. True when both wrote the
    same tokens, so the position-by-position comparison applies."""
    info = generation.generation(base.trace) or generation.generation(iv.trace)
    if info is None:
        return True
    a, b = base.trace.token_ids, iv.trace.token_ids
    parted = generation.first_difference(a, b)
    start = int(info["start"])
    st.subheader("Where the texts part", anchor=False)
    if parted is None:
        st.metric("First differing step", "none", help="Both runs wrote the same tokens")
    else:
        st.metric("First differing step", f"position {parted} (step {parted - start + 1})", help="outlined in red below")
    left, right = st.columns(2, gap="large")
    for column, entry, title in ((left, base, "Baseline"), (right, iv, "Intervened")):
        with column, st.container(border=True):
            st.markdown(f"**{title}** · {widgets.escape_md(origin(entry))}")
            st.html(generation.coloured_text(entry.table("steps"), start, parted))
    if parted is None:
        return True
    st.info(
        f"The two runs wrote different tokens from position {parted} on: the block-by-block comparison needs the same "
        "tokens in both runs. Set **Generate** to 0 in the sidebar to compare the prompt alone.",
        icon=":material/call_split:",
    )
    return False


def memo_figure(iv: Entry, base: Entry, name: str, build):
    return iv.memo(("figure", "interventions", name, base.key), build)


def token_text(tables: dict, token_id: int) -> str:
    """A token of the diff's next_token table as a metric shows it: visible, markdown escaped."""
    frame = tables.get("next_token")
    names = dict(zip(frame["token_id"], frame["token"], strict=True)) if frame is not None else {}
    return widgets.escape_md(tokens.show_token(str(names.get(token_id, f"<{token_id}>")), html_escape=False))


def next_token_metric(where, info: dict, tables: dict) -> None:
    """The top next token of run a and of run b (the diff's summary), as text."""
    if "next_token_a" not in info:
        return
    before, after = token_text(tables, info["next_token_a"]), token_text(tables, info["next_token_b"])
    where.metric("Top next token", f"{before} → {after}" if before != after else f"{before} (same)")


def summary_metrics(info: dict, tables: dict, n_layers: int, move: interventions.LogitMove | None) -> None:
    """Two rows: how the prediction after the last position moved (the causal check reads it), then where."""
    cols = st.columns(3)
    next_token_metric(cols[0], info, tables)
    if move is not None:
        rank = "still the top prediction" if move.rank_after == 0 else f"now ranked {move.rank_after + 1}"
        cols[1].metric(
            f"Logit of {token_text(tables, move.token_id)}",
            f"{move.after:.3f}",
            f"{move.after - move.before:+.3f}",
            help=f"The baseline's top next token after the last position: logit {move.before:.4f} in the baseline, "
            f"{move.after:.4f} intervened ({rank}). Removing a part that attribution says raised it should lower it.",
        )
    kl = info.get("next_token_kl")
    cols[2].metric(
        "Next-token KL",
        "—" if kl is None else f"{kl:.4g} nats",
        help="KL(baseline ‖ intervened) of the next-token distribution after the last position",
    )
    cols = st.columns(3)
    first = info.get("first_block_changed")
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
    drift = info.get("max_rel_l2_per_block")
    if drift:
        st.caption(
            f"Largest relative L2 drift of the stream per block: {', '.join(f'{v:.3g}' for v in drift)} "
            f"(blocks 0–{n_layers - 1})."
        )


def load_change(base: Entry, iv: Entry, spec: dict[str, Any]) -> None:
    blocks = router.moe_blocks(base.trace)
    if not blocks:
        st.caption("No MoE blocks in this trace: no expert load to compare.")
        return
    ablated, zeroed = ({int(b): tuple(ids) for b, ids in (spec.get(key) or {}).items()} for key in ("ablate", "zero_experts"))
    options = blocks
    if st.session_state.get("iv_load_block") not in options:
        st.session_state["iv_load_block"] = next(iter(ablated or zeroed), blocks[0])
    block = st.selectbox("Expert load of", options, key="iv_load_block", format_func=lambda b: f"block {b}")
    before = experts.expert_tokens(base.trace, block)
    after = experts.expert_tokens(iv.trace, block)
    if before is None or after is None:
        widgets.missing("No routing", ["layers.{i}.ffn.gate.topk_indices"], block)
        return
    cfg = base.trace.config
    fig = memo_figure(
        iv,
        base,
        ("load", block),
        lambda: interventions.expert_load_change_figure(
            before, after, ablated.get(block, ()), block, cfg.experts_per_group, zeroed.get(block, ())
        ),
    )
    widgets.chart(fig, "iv_load")


def diff_downloads(base: Entry, iv: Entry, tables: dict) -> None:
    st.subheader("Diff tables", anchor=False)
    stem = "diff-" + iv.key.fingerprint()
    cols = st.columns(3)
    widgets.download(
        cols[0],
        "All diff tables (CSV, zip)",
        lambda: zip_bytes(tables),
        f"{stem}-tables.zip",
        ZIP,
        "iv_dl_zip",
        ":material/folder_zip:",
    )
    widgets.download(
        cols[1],
        "Intervened trace (.safetensors)",
        iv.trace_bytes,
        f"{stem}-intervened.safetensors",
        OCTETS,
        "iv_dl_trace",
        ":material/save:",
        help="Open it here (source: Trace file) or compare with `python -m tracing diff`",
    )
    if st.session_state.get("trace_key") == iv.key:  # showing the intervened run: offer the baseline
        label, key, shown, icon, tip = "Show the baseline in the other pages", "iv_show_base", base.key, ":material/undo:", None
    else:
        label, key, shown, icon = "Show the intervened trace in the other pages", "iv_show", iv.key, ":material/visibility:"
        tip = "The residual, attention and router pages then draw the intervened run"
    cols[2].button(label, key=key, on_click=_show, args=(shown,), icon=icon, width="stretch", help=tip)
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
            widgets.table(st, shown.head(MAX_ROWS), f"diff {name}")


def show_pair(a: Entry, b: Entry, tables: dict, info: dict) -> None:
    """The prompt on two checkpoints: what differs (summary metrics), per block, every diff table."""
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
        next_token_metric(cols[3], info, tables)
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
            st.dataframe(tables[name].head(MAX_ROWS), hide_index=True, width="stretch")
