"""Attention and indexer: index scores with the selected keys, the main attention pattern, the
indexer's recall of the dense attention mass, and one query in detail."""

from __future__ import annotations

import streamlit as st

from app.core.session import View
from app.topics import attention, card_plots, tokens
from app.ui import card_view, widgets

SCORES = "layers.{i}.attn.indexer.scores"


def page() -> None:
    view = card_view.topic_page(
        "Attention & indexer",
        "DeepSeek Sparse Attention: the lightning indexer scores every earlier key for each query and keeps "
        "the top-k; MLA then attends only to those. Compare what the indexer chose with where attention went.",
        ["indexer", "sparse_mask", "mla"],
        "attention",
    )
    if view is None:
        return
    if view.config.has_indexer and view.n_tokens <= view.config.index_topk:
        st.caption(
            f":material/info: The prompt has {view.n_tokens} tokens and index_topk is {view.config.index_topk}: every "
            "query keeps all its earlier keys, so sparse attention equals dense attention here. Trace a prompt longer "
            f"than {view.config.index_topk} tokens to see keys dropped."
        )
    widgets.lazy_tabs(
        {
            "Index scores": lambda: _index_scores(view),
            "Attention": lambda: _attention(view),
            "Indexer recall": lambda: _recall(view),
            "One query": lambda: _one_query(view),
            "Sinks": lambda: _sinks(view),
        },
        "attention_tab",
    )


def _index_scores(view: View) -> None:
    if not view.config.has_indexer:
        return widgets.no_indexer()
    block = view.block
    if widgets.memo_chart(view, "index_scores", lambda: card_plots.index_scores(view, block), block) is None:
        widgets.missing("No index scores", [SCORES], block)


def _attention(view: View) -> None:
    block = view.block
    heads = attention.recorded_heads(view.trace, block)
    head = None
    if heads:
        pick, _ = st.columns([1, 3])
        choice = pick.selectbox(
            "Attention heads",
            ["mean", *range(heads)],
            key="attention_head",
            format_func=lambda h: "mean over heads" if h == "mean" else f"head {h}",
        )
        head = None if choice == "mean" else int(choice)
    skip = widgets.first_token_toggle("attention_skip_first", "key 0 (the attention sink)")
    build = lambda: card_plots.attention_pattern(view, block, head=head, skip_first=skip)  # noqa: E731
    if widgets.memo_chart(view, "attention_pattern", build, block, head, skip) is None:
        widgets.missing("No attention pattern", ["layers.{i}.attn.probs_mean"], block)


def _recall(view: View) -> None:
    if not view.config.has_indexer:
        return widgets.no_indexer()
    k = min(view.config.index_topk, view.n_tokens)
    st.caption(
        f"For each query: the share of dense attention's probability mass (softmax over all earlier keys, mean "
        f"over heads) that falls on the {k} keys the indexer kept. 1 = nothing lost."
    )
    got = attention.recall_grid(view.table("indexer_recall"), view.n_tokens)
    if got is None:
        widgets.missing("No recall", ["layers.{i}.attn.indexer.recall"])
    else:
        widgets.memo_chart(view, "recall", lambda: attention.recall_figure(got[0], got[1], tokens.labels(view)))
    quality = attention.indexer_quality(view.table("indexer_recall"), view.config.index_topk)
    if quality is not None:
        st.caption(
            f"Per block, over the queries that see more than {view.config.index_topk} keys: recall; `kl`, the KL "
            "divergence (nats) of the indexer's distribution (softmax of its scores) from the dense attention's, mean "
            "over heads (its training objective: 0 = the same); `overlap_prev`, the Jaccard overlap of the kept keys "
            "with the block before's."
        )
        widgets.table(st, quality, "indexer quality per block")


def _sinks(view: View) -> None:
    k = view.config.index_topk
    if not view.config.has_indexer:
        return widgets.no_indexer()
    if view.n_tokens <= k:
        st.info(
            f"No query had to choose: the prompt has {view.n_tokens} tokens and index_topk is {k}, so every query keeps "
            f"all its keys. Trace a prompt longer than {k} tokens to see which keys the indexer keeps from afar.",
            icon=":material/info:",
        )
        return
    frame = view.table("sinks")
    got = attention.sinks_grid(frame)
    if got is None:
        widgets.missing("No selected keys", ["layers.{i}.attn.indexer.topk_indices"])
        return
    blocks, share = got
    st.caption(
        f"Keys kept from afar, as the atlas's sinks (`indexer_sinks`) count them over a corpus: by queries at least {k} "
        f"positions later, which had {k} nearer keys to choose from. `share` = `kept` / `queries`: of those queries, "
        "the share that kept the key. Each block's keys, most kept first."
    )
    build = lambda: attention.sinks_figure(blocks, share, tokens.labels(view), k)  # noqa: E731
    widgets.memo_chart(view, "attention_sinks", build)
    widgets.table(st, frame, "prompt-sinks")
    widgets.csv_button(st, frame, "prompt-sinks.csv", key="attention_sinks_csv")


def _one_query(view: View) -> None:
    if not view.config.has_indexer:
        return widgets.no_indexer()
    block = view.block
    labels = tokens.labels(view)
    if st.session_state.get("query", 0) >= view.n_tokens:
        st.session_state["query"] = view.n_tokens - 1
    if "query" not in st.session_state:
        st.session_state["query"] = view.n_tokens - 1
    query = st.selectbox("Query position", range(view.n_tokens), key="query", format_func=lambda i: labels[i])
    df = attention.query_profile(view.trace, block, query)
    if df is None:
        widgets.missing("No index scores", [SCORES], block)
        return
    token = tokens.token_texts(view.trace)[query]
    widgets.memo_chart(view, "query_profile", lambda: attention.query_profile_figure(df, query, token, block), block, query)
    box = widgets.lazy_expander("As a table", "query_table")
    if box is not None:
        widgets.table(box, df, f"block {block} query {query}")


if __name__ == "__main__":
    page()
