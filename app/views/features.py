"""Features: a sparse dictionary's features, from the pages ``python -m tracing dictionary features``
wrote over a corpus (each feature's strongest contexts, the tokens it promotes, the experts its
positions are routed to against the base rates, how often the indexer keeps them; per expert the
features it carries), and the session's prompt read with a dictionary, one feature edited."""

from __future__ import annotations

from pathlib import Path

import streamlit as st

from app.core import paths, settings
from app.core.errors import BAD_INPUT
from app.core.session import session_model
from app.topics import features as topic
from app.ui import widgets
from tracing.runner import TraceRequest

PAGES_DIR = "a feature pages directory"  # what the directory field opens, in its one refusal (app.core.paths)
DICTIONARY = "a dictionary directory"
SOURCE_LABELS = {"bundled": "Bundled demo pages", "dir": "Pages directory"}


@st.cache_resource(max_entries=8, show_spinner=False)
def _read(path: str, stamp: tuple, limit: int) -> topic.Pages:  # stamp: a rewritten directory reloads
    return topic.read_pages(path, limit)


def _open() -> topic.Pages | None:
    """The pages the sidebar names, or None after saying why not."""
    with st.sidebar:
        st.markdown("#### Feature pages")
        sources = ("bundled", "dir") if topic.bundled_pages() else ("dir",)
        if st.session_state.get("feat_source") not in sources:
            st.session_state["feat_source"] = sources[0]
        source = st.radio("Pages source", sources, key="feat_source", format_func=SOURCE_LABELS.get)
        try:
            if source == "bundled":
                return _read(str(topic.BUNDLED), topic.stamp(str(topic.BUNDLED)), settings.max_upload_bytes())
            typed = st.text_input(
                "Pages directory",
                key="feat_dir",
                placeholder="pages-out/",
                help="The --out DIR of `python -m tracing dictionary features`" + paths.roots_help("feature pages"),
            )
            if not typed.strip():
                st.caption("Type the path of a pages directory and press Enter.")
                return None
            with paths.refused_alike(PAGES_DIR, typed, (topic.PagesError, OSError, ValueError)):
                folder = paths.confine(Path(typed.strip()).expanduser(), PAGES_DIR, topic.SUMMARY)
                return _read(str(folder), topic.stamp(str(folder)), settings.max_upload_bytes())
        except (*BAD_INPUT, OSError, ValueError) as exc:
            st.error(f"**Pages not opened.** {widgets.escape_md(str(exc))}", icon=":material/error:")
            return None


def page() -> None:
    st.header("Features", anchor=False)
    st.caption(
        "What a sparse dictionary's features are, read from a corpus: each feature's strongest contexts, the tokens "
        "its direction promotes, the experts its positions are routed to against the block's base rates, and how "
        "often the indexer keeps its strongest positions; per expert, the features it carries. Made by "
        "`python -m tracing dictionary features`. *This prompt* reads the session's prompt with a dictionary."
    )
    section = st.segmented_control("Show", topic.SECTIONS, key="feat_section") or topic.SECTIONS[0]
    if section == "This prompt":
        _this_prompt()
        return
    pages = _open()
    if pages is None:
        return
    names = pages.dictionaries
    if st.session_state.get("feat_dictionary") not in names:
        st.session_state["feat_dictionary"] = names[0]
    dictionary = st.selectbox("Dictionary", names, key="feat_dictionary")
    if section == "Features":
        _features(pages, dictionary)
    elif section == "One feature":
        _one_feature(pages, dictionary)
    else:
        _experts(pages, dictionary)


def _features(pages: topic.Pages, dictionary: str) -> None:
    query = st.text_input("Search", key="feat_search", placeholder="a feature id, or part of a token", max_chars=200)
    frame = topic.search(pages, dictionary, query)
    st.caption(
        f"{len(frame):,} features, strongest first: a number finds that feature, text the features whose strongest "
        "contexts or promoted tokens hold it. `density`: the share of the corpus's positions where it is active; "
        "`top_expert_share` against `top_expert_base`: its positions' routing against the block's."
    )
    if frame["active_positions"].gt(0).any():
        widgets.chart(topic.overview_figure(frame, dictionary), key="feat_overview")
    widgets.table(st, frame, f"{dictionary}-features")
    widgets.csv_button(st, frame, f"{dictionary}-features.csv", key="feat_csv_features")


def _one_feature(pages: topic.Pages, dictionary: str) -> None:
    feature = int(st.number_input("Feature", min_value=0, step=1, key="feat_id"))
    shown = topic.one_feature(pages, dictionary, feature)
    if shown is None:
        st.info(f"The pages of {widgets.escape_md(dictionary)} have no feature {feature}.", icon=":material/search_off:")
        return
    st.markdown(
        f"**Feature {feature}** of {widgets.escape_md(dictionary)}: {widgets.escape_md(topic.describe(shown['summary']))}."
    )
    st.markdown("Strongest contexts (the position's token in `[[ ]]`)")
    _with_csv(shown["contexts"], f"{dictionary}-feature-{feature}-contexts")
    promoted, suppressed = st.columns(2, gap="large")
    with promoted:
        st.markdown("Tokens its direction promotes (through the final norm's gain and the head)")
        _with_csv(shown["promoted"], f"{dictionary}-feature-{feature}-promoted")
    with suppressed:
        st.markdown("Tokens it suppresses")
        _with_csv(shown["suppressed"], f"{dictionary}-feature-{feature}-suppressed")
    if not shown["experts"].empty:
        widgets.chart(topic.experts_figure(shown["experts"], feature), key="feat_experts_figure")
        _with_csv(shown["experts"], f"{dictionary}-feature-{feature}-experts")


def _experts(pages: topic.Pages, dictionary: str) -> None:
    blocks = topic.expert_blocks(pages, dictionary)
    if not blocks:
        st.info("No MoE block reads this dictionary's features after its site.", icon=":material/info:")
        return
    left, right = st.columns(2)
    block = left.selectbox("Block", blocks, key="feat_block", format_func=lambda b: f"block {b}")
    expert = int(right.number_input("Expert", min_value=0, step=1, key="feat_expert"))
    frame = topic.expert_features(pages, dictionary, block, expert)
    st.caption(
        f"The features expert {expert} of block {block} carries most: `activation_mass` sums their activations over "
        "the positions routed to it, `positions` counts them (of `expert_positions`)."
    )
    _with_csv(frame, f"{dictionary}-block-{block}-expert-{expert}-features")


def _with_csv(frame, name: str) -> None:
    widgets.table(st, frame, name)
    widgets.csv_button(st, frame, f"{name}.csv", key=f"feat_csv_{name}")


def _this_prompt() -> None:
    """The session's prompt traced with a dictionary, plain and with one feature edited."""
    model = session_model()
    if model is None:
        st.info("Choose a model in the sidebar: the prompt runs through it.", icon=":material/info:")
        return
    served = topic.served_dictionaries(model)  # a model server applies its own, named (serve --dictionaries)
    if served is not None and not served:
        st.info("This model server holds no dictionary: start it with `serve --dictionaries DIR`.", icon=":material/info:")
        return
    options = list(served) if served is not None else [*topic.bundled_dictionaries(), topic.TYPED]
    choice = st.selectbox("Dictionary", options, key="feat_prompt_dictionary")
    typed = ""
    if choice == topic.TYPED:
        typed = st.text_input(
            "Dictionary directory",
            key="feat_dict_dir",
            placeholder="dictionary/ (cfg.json, sae_weights.safetensors)",
            help="A dictionary in SAELens's layout, e.g. the --out DIR of `python -m tracing dictionary train`"
            + paths.roots_help("dictionaries"),
        )
        if not typed.strip():
            st.caption("Type a dictionary's directory; the prompt's features there, and one of them edited, appear here.")
            return
    left, middle, right, last = st.columns(4)
    feature = int(left.number_input("Feature", min_value=0, step=1, key="feat_id"))
    edit = middle.selectbox("Edit", topic.EDITS, key="feat_edit")
    amount = float(right.number_input("Scale or amount", key="feat_amount", disabled=edit == "zero"))
    positions = last.text_input("Positions", key="feat_positions", placeholder="all, or P, or A:B")
    if st.button("Trace with the dictionary", key="feat_run", type="primary"):
        try:
            from tracing.dictionary import load

            if served is not None:  # the server's, by name
                d, site = choice, served[choice]["site"]
            elif choice == topic.TYPED:  # under the roots, what it holds is refused alike (app.core.paths)
                with paths.refused_alike(DICTIONARY, typed, (*BAD_INPUT, OSError, ValueError)):
                    d = load(paths.confine(Path(typed.strip()).expanduser(), DICTIONARY, "cfg.json"))
                site = d.site
            else:
                d = load(topic.DICTIONARIES / choice)
                site = d.site
            prompt = st.session_state.get("prompt", settings.DEFAULT_PROMPT)
            spec = topic.edit_spec(site, feature, edit, amount, positions)
            plain = model.trace(TraceRequest(prompt=prompt, record=("logits.last",), dictionaries=(d,)), None, model.max_tokens())
            edited = model.trace(
                TraceRequest(prompt=prompt, record=("logits.last",), dictionaries=(d,), interventions={"features": spec}),
                None,
                model.max_tokens(),
            )
            st.session_state["feat_traced"] = (site, spec, plain, edited)
        except (*BAD_INPUT, OSError, ValueError) as exc:
            st.error(f"**Not traced.** {widgets.escape_md(str(exc))}", icon=":material/error:")
            return
    traced = st.session_state.get("feat_traced")
    if traced is None:
        return
    site, spec, plain, edited = traced
    st.markdown(f"The prompt's features at `{site}`, and the top next tokens with `{widgets.escape_md(spec)}`.")
    _with_csv(topic.prompt_features(plain, site), "prompt-features")
    _with_csv(topic.next_tokens(plain, edited), "prompt-next-tokens-edited")


if __name__ == "__main__":
    page()
