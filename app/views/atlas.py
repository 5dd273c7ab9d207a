"""Atlas: the experts and the sparse attention across a whole corpus. Opens the directory a
``python -m tracing atlas`` run wrote (or its files zipped); the bundled demo atlas opens at once.
Needs no trace and no model."""

from __future__ import annotations

import hashlib
from pathlib import Path

import streamlit as st

from app.core import paths, settings
from app.topics import atlas as topic
from app.ui import widgets
from tracing.atlas import Atlas, AtlasError
from tracing.errors import InputError

SOURCES = ("bundled", "dir", "upload")
SOURCE_LABELS = {"bundled": "Bundled demo atlas", "dir": "Atlas directory", "upload": "Zipped atlas"}
ATLAS = "an atlas directory"  # what the directory field opens, in its one refusal (app.core.paths)
SUMMARY = "summary.json"
SECTIONS = ("Expert load", "Experts", "Token search", "Co-activation", "One expert", "Routing bias", "Indexer")
OPENED = "atlas_opened"  # the atlas this session opened last: the Router page draws its experts


@st.cache_resource(max_entries=8, show_spinner=False)
def _open_dir(path: str, stamp: tuple) -> Atlas:  # stamp: the files' sizes and times, so a rewritten atlas reloads
    return topic.read_atlas(path)


@st.cache_resource(max_entries=4, show_spinner=False)
def _open_zip(digest: str, data: bytes, name: str, limit: int) -> Atlas:
    return topic.open_zip(data, name, limit)


def _open_typed(value: str) -> Atlas:
    """The atlas directory a visitor typed, confined as every path field is (app.core.paths)."""
    with paths.refused_alike(ATLAS, value, (AtlasError, OSError, ValueError)):
        folder = paths.confine(Path(value).expanduser(), ATLAS, SUMMARY)
        return _open_dir(str(folder), topic.stamp(str(folder)))


def _open() -> Atlas | None:
    """The atlas the page's sidebar names, or None after saying why not."""
    with st.sidebar:
        st.markdown("#### Atlas")
        source = st.radio("Atlas source", SOURCES, key="atlas_source", format_func=SOURCE_LABELS.get)
        try:
            if source == "bundled":
                if not (topic.BUNDLED / "summary.json").is_file():
                    st.error("The bundled demo atlas is missing (assets/demo_atlas): build it with the command in docs/atlas.md.")
                    return None
                return _open_dir(str(topic.BUNDLED), topic.stamp(str(topic.BUNDLED)))
            if source == "dir":
                path = st.text_input(
                    "Atlas directory",
                    key="atlas_dir",
                    placeholder="atlas-out/",
                    help="The --out DIR of `python -m tracing atlas`" + paths.roots_help("atlases"),
                )
                if not path.strip():
                    st.caption("Type the path of an atlas directory and press Enter.")
                    return None
                return _open_typed(path.strip())
            upload = st.file_uploader(
                "Zipped atlas",
                type=["zip"],
                key="atlas_upload",
                help="The atlas directory's files (summary.json and the .parquet tables) in one .zip",
            )
            if upload is None:
                st.caption("Drop a .zip of an atlas directory here: it is read as data only.")
                return None
            data = upload.getvalue()
            return _open_zip(hashlib.sha256(data).hexdigest(), data, upload.name, settings.max_upload_bytes())
        except (AtlasError, InputError, OSError, ValueError) as exc:  # ValueError: a NUL byte in a typed path
            st.error(f"**Atlas not opened.** {widgets.escape_md(str(exc))}", icon=":material/error:")
            return None


def page() -> None:
    st.header("Atlas", anchor=False)
    st.caption(
        "The router and the sparse attention counted over a whole corpus, not one prompt: which experts carry the "
        "load, which fire together, what each is for, what the correction bias changes, and how far back the "
        "indexer reaches. Made by `python -m tracing atlas`."
    )
    atlas = _open()
    if atlas is None:
        return
    st.session_state[OPENED] = atlas
    summary = atlas.summary
    st.markdown(
        f":gray-badge[:material/description: {summary.get('sequences', 0):,} sequences] "
        f":gray-badge[:material/notes: {summary.get('tokens', 0):,} tokens] "
        f":gray-badge[:material/memory: {widgets.escape_md(str(summary.get('checkpoint', '?')))}] "
        f":gray-badge[:material/speed: {summary.get('tokens_per_s', 0):,.0f} tokens/s]"
    )
    section = st.segmented_control("Show", SECTIONS, key="atlas_section", default=SECTIONS[0]) or SECTIONS[0]
    moe = topic.blocks(atlas)
    if section == "Expert load":
        _expert_load(atlas)
    elif section == "Routing bias":
        widgets.chart(topic.bias_figure(atlas), key="atlas_bias")
        _table(atlas, "bias_effect")
        _block_measures(atlas, topic.near_tie_figure(atlas), "atlas_near_ties")
    elif section == "Indexer":
        _indexer(atlas)
    elif not moe:
        st.info("This atlas counted no MoE block.")
    elif section == "Experts":
        _experts(atlas)
    elif section == "Token search":
        _token_search(atlas)
    elif section == "Co-activation":
        block = st.selectbox("Block", moe, key="atlas_block", format_func=lambda b: f"block {b}")
        as_lift = st.toggle("As lift (observed / independent)", key="atlas_lift", value=True)
        matrix = topic.pair_matrix(atlas, block)
        widgets.chart(topic.coactivation_figure(matrix, int(summary.get("tokens", 0)), block, as_lift), key="atlas_pairs")
    else:
        _one_expert(atlas, moe)


def _expert_load(atlas: Atlas) -> None:
    sort = st.toggle("Sort each block's experts by load", key="atlas_sorted")
    widgets.chart(topic.load_figure(atlas, sort), key="atlas_load")
    table = topic.imbalance(atlas)
    if not table.empty:
        widgets.chart(topic.imbalance_figure(table), key="atlas_imbalance")
    groups = topic.group_figure(atlas)
    if groups is not None:
        with st.expander("Group load"):
            widgets.chart(groups, key="atlas_groups")
    _table(atlas, "expert_load")


def session_atlas() -> Atlas | None:
    """The atlas this session opened on this page last, else the bundled demo atlas (None without one)."""
    atlas = st.session_state.get(OPENED)
    if atlas is None and (topic.BUNDLED / SUMMARY).is_file():
        try:
            atlas = _open_dir(str(topic.BUNDLED), topic.stamp(str(topic.BUNDLED)))
        except (AtlasError, OSError):
            return None
    return atlas


def _experts(atlas: Atlas) -> None:
    search = st.text_input(
        "Search",
        key="atlas_search",
        placeholder="a block or expert number, or part of a token",
        help="Keeps the rows whose block or expert is the number typed, or one of whose most specific tokens holds the text",
    )
    frame = topic.experts(atlas, search)
    st.caption(
        f"{len(frame):,} experts. Every block's routed experts: `count` tokens that chose it, `share` of the block's "
        "selections, `mean_weight` its mean gate weight (after the router's route_scale, so it may exceed 1: the "
        "weights of a token's k experts sum to route_scale), and its five most specific tokens (specificity: PMI with a "
        "count prior). Click a column to sort."
    )
    widgets.table(st, frame, "experts")
    widgets.csv_button(st, frame, "experts.csv", key="atlas_csv_experts")


def _token_search(atlas: Atlas) -> None:
    text = st.text_input(
        "Token",
        key="atlas_token",
        placeholder="a token as the tokenizer writes it (leading space included), or its id",
    )
    if not text:
        st.caption("Type a token, or its id, to see which experts take it in each block.")
        return
    token, label, routes, line = topic.token_search(atlas, text)
    if routes is None:
        st.info(widgets.escape_md(line), icon=":material/search_off:")
        return
    st.markdown(widgets.escape_md(line))
    n = int(atlas.summary.get("n_routed_experts") or routes["expert"].max() + 1)
    widgets.chart(topic.token_figure(routes, label, n), key="atlas_token_figure")
    st.caption(
        "Per block, the experts that took the token: `count` of its occurrences that chose the expert, `share` of its "
        "routings in the block (count / (occurrences x k)), `specificity` as in One expert."
    )
    widgets.table(st, routes, f"token-{token}-experts")
    widgets.csv_button(st, routes, f"token-{token}-experts.csv", key="atlas_csv_token")


def _one_expert(atlas: Atlas, moe: list[int]) -> None:
    left, right = st.columns(2)
    block = left.selectbox("Block", moe, key="atlas_block", format_func=lambda b: f"block {b}")
    matrix = topic.pair_matrix(atlas, block)
    n = matrix.shape[0]
    expert = right.number_input("Expert", min_value=0, max_value=n - 1, step=1, key="atlas_expert")
    card = topic.expert_card(atlas, block, int(expert), matrix)
    st.markdown(
        f"**Expert {expert} of block {block}**: chosen for {card['count']:,} tokens ({card['share'] * 100:.2f}% of the "
        f"block's selections, uniform {100 / n:.2f}%), mean gate weight {card['mean_weight']:.3f}."
    )
    tokens, partners = st.columns(2, gap="large")
    with tokens:
        st.markdown("Most specific tokens (PMI: how much more often than its load predicts)")
        widgets.table(st, card["tokens"], "expert tokens")
    with partners:
        st.markdown("Partners (tokens that chose both)")
        widgets.table(st, card["partners"], "expert partners")


def _indexer(atlas: Atlas) -> None:
    widgets.chart(topic.distance_figure(atlas), key="atlas_distance")
    recall = topic.recall_figure(atlas)
    if recall is None:
        st.caption("No query saw more keys than index_topk: every key was kept, recall is 1.")
    else:
        widgets.chart(recall, key="atlas_recall")
    blocks = sorted(int(b) for b in atlas.tables["indexer_sinks"]["block"].unique())
    if blocks:
        block = st.selectbox("Sinks of block", blocks, key="atlas_sink_block", format_func=lambda b: f"block {b}")
        positions, tokens = topic.sinks(atlas, block)
        left, right = st.columns(2, gap="large")
        left.markdown("Key positions picked from afar, against the rate at their distances (lift)")
        widgets.table(left, positions, "sink positions")
        right.markdown("Tokens picked from afar, against the rate at their distances (lift)")
        widgets.table(right, tokens, "sink tokens")
    _block_measures(atlas, topic.overlap_figure(atlas), "atlas_overlap")


def _block_measures(atlas: Atlas, fig, key: str) -> None:
    """A figure of the block_measures table, or why there is none."""
    if "block_measures" not in atlas.tables:
        st.caption("This atlas was built before it counted the per-block overlaps and near-ties: build it again for them.")
        return
    if fig is not None:
        widgets.chart(fig, key=key)
    _table(atlas, "block_measures")


def _table(atlas: Atlas, name: str) -> None:
    with st.expander(f"The {name} table"):
        widgets.table(st, atlas.tables[name], name)
        widgets.csv_button(st, atlas.tables[name], f"{name}.csv", key=f"atlas_csv_{name}")


if __name__ == "__main__":
    page()
