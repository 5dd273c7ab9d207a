"""Generation: follow the model as it writes. The text with each new token coloured by its
probability; for a chosen step, what the pass that wrote it did (alternatives, experts, indexer
picks, logit lens); and across the steps, one block's experts and the indexer's reach."""

from __future__ import annotations

import pandas as pd
import streamlit as st

from app.core.markup import code_md, escape_md
from app.core.session import View
from app.topics import card_plots, generation, predictions, tokens
from app.ui import card_view, widgets


def page() -> None:
    view = card_view.topic_page(
        "Generation",
        "The model writing: each new token chosen from the last position's distribution and fed back alone "
        "through the decode path (absorbed attention over the cached latents, the indexer over the cached keys).",
        ["head", "indexer", "router"],
        "generation",
    )
    if view is None:
        return
    trace = view.trace
    steps = view.table("steps")
    if steps.empty:
        widgets.missing("No steps", ["next.topk_indices", "next.topk_probs"])
        return
    info = generation.generation(trace)
    if info is None:
        st.info(
            "This trace only reads its prompt. To watch the model write, set **Generate** in the sidebar to a "
            "number of new tokens (greedy, or sampled with a temperature, top-p and seed) and press **Trace**; "
            "on the command line: `python -m tracing run ... --generate N`.",
            icon=":material/edit_note:",
        )
        widgets.memo_chart(view, "gen_probs", lambda: generation.probability_figure(steps, None))
        box = widgets.lazy_expander("Every position as a table", "generation_steps_table")
        if box is not None:
            widgets.table(box, steps, "steps")
        return
    start = int(info["start"])
    how = (
        "greedy"
        if not info.get("temperature")
        else f"sampled at T = {info['temperature']:g}, top-p {info.get('top_p', 1):g}, seed {info.get('seed')}"
    )
    st.caption(
        f":material/edit_note: {escape_md(info['generated'])} tokens written after a prompt of {start} ({escape_md(how)}); "
        f"stopped by {'the end-of-sequence token' if info['stopped'] == 'eos' else 'the length asked for'}. "
        "Colour: the probability each token was written with (red unlikely, green certain); hover a token for more."
    )
    st.html(generation.coloured_text(steps, start))
    widgets.lazy_tabs(
        {
            "Alternatives": lambda: _alternatives(view, steps),
            "Experts": lambda: _experts(view, steps),
            "Indexer picks": lambda: _indexer_picks(view, steps),
            "Logit lens": lambda: _logit_lens(view, steps),
            "MTP drafts": lambda: _mtp(view, steps, info, start),
            "As the text grows": lambda: timeline(view),
            "Probabilities": lambda: widgets.memo_chart(view, "gen_probs", lambda: generation.probability_figure(steps, start)),
            "Every step": lambda: widgets.table(st, steps, "steps"),
        },
        "generation_tab",
    )


def one_step(view: View, steps: pd.DataFrame) -> int:
    """The step chooser and what the chosen token was written with; the position of the pass that wrote it."""
    trace = view.trace
    written = generation.written(trace)
    if st.session_state.get("gen_step") not in written:
        st.session_state["gen_step"] = written[0]
    step = st.select_slider(
        "Generated token",
        written,
        key="gen_step",
        format_func=lambda p: generation.step_label(trace, p),
        help="Each token was written by the pass at the position before it: the views of one step show that pass.",
    )
    query = step - 1
    row = steps.iloc[step]
    st.markdown(
        f"Position **{step}** {code_md(tokens.show_token(row['token'], html_escape=False))} was written with p = "
        f"**{row['chosen_prob']:.3f}** (entropy {row['entropy']:.2f} nats) by the pass at position {query} "
        f"(reading {code_md(tokens.show_token(trace.tokens[query], html_escape=False))}, "
        f"{escape_md(steps['phase'].iloc[query])})."
    )
    return query


def _alternatives(view: View, steps: pd.DataFrame) -> None:
    step = one_step(view, steps) + 1
    alts = generation.alternatives(steps, step)
    widgets.memo_chart(view, "gen_alts", lambda: generation.alternatives_figure(alts, step), step)


def _experts(view: View, steps: pd.DataFrame) -> None:
    query = one_step(view, steps)
    got = view.memo(("gen_experts_at", query), lambda: generation.experts_at(view.trace, query))
    if got is None:
        widgets.missing("No experts", ["layers.{i}.ffn.gate.topk_indices"])
    else:
        widgets.memo_chart(view, "gen_experts_at", lambda: generation.experts_at_figure(*got, query), query)


def _indexer_picks(view: View, steps: pd.DataFrame) -> None:
    query = one_step(view, steps)
    row_scores = generation.indexer_row(view.trace, view.block, query)
    if row_scores is None:
        widgets.missing("No indexer picks", ["layers.{i}.attn.indexer.scores"], view.block)
        return
    labels = tokens.labels(view)
    build = lambda: generation.indexer_row_figure(*row_scores, labels, view.block, query)  # noqa: E731
    widgets.memo_chart(view, "gen_indexer_row", build, view.block, query)


def _logit_lens(view: View, steps: pd.DataFrame) -> None:
    query = one_step(view, steps)
    lens = view.memo("lens", lambda: predictions.logit_lens(view.trace))
    if lens is None:
        widgets.missing("No logit lens", ["layers.{i}.logit_lens.topk_indices"])
        return
    chosen = tokens.show_token(steps.iloc[query + 1]["token"], html_escape=False)
    widgets.memo_chart(view, "gen_lens", lambda: generation.lens_at_figure(lens, query, chosen), query)


def _mtp(view: View, steps: pd.DataFrame, info: dict, start: int) -> None:
    """The multi-token-prediction module's draft of each written token and whether the model wrote it."""
    drafts = generation.mtp_drafts(steps, start)
    if drafts is None:
        note = view.trace.extra.get("mtp")
        if note:
            st.caption(f":material/info: {escape_md(note)}.")
        else:
            widgets.missing("No MTP drafts", ["mtp.topk_indices"])
        return
    if (line := generation.mtp_summary(info)) is not None:
        st.caption(f":material/bolt: {escape_md(line)}")
    widgets.memo_chart(view, "gen_mtp", lambda: generation.mtp_figure(drafts))
    widgets.table(st, drafts, "mtp drafts")


def timeline(view: View) -> None:
    trace = view.trace
    written = generation.written(trace)
    block, note = card_plots.applicable_block("moe", view.config, view.block)
    if note:
        st.caption(f":material/info: {note}")
    rows = [generation.step_label(trace, p) for p in written]
    grid = (
        None if block is None else view.memo(("gen_timeline", block), lambda: generation.expert_timeline(trace, block, written))
    )
    if grid is not None:
        widgets.memo_chart(view, "gen_timeline", lambda: generation.expert_timeline_figure(grid, rows, block), block)
    elif block is not None:
        widgets.missing("No expert timeline", ["layers.{i}.ffn.gate.topk_indices"], block)
    distance = view.memo(("gen_distance", view.block), lambda: generation.key_distance(trace, view.block, written))
    if distance is None:
        widgets.missing("No indexer reach", ["layers.{i}.attn.indexer.topk_indices"], view.block)
    else:
        widgets.memo_chart(view, "gen_distance", lambda: generation.key_distance_figure(distance, view.block), view.block)


if __name__ == "__main__":
    page()
