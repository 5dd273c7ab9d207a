"""The Streamlit app, run headless with AppTest on the bundled demo (a tiny checkpoint with a tokenizer
stands in while assets/demo is absent): every page renders its cards and plots, exports write the
tables' CSV header, and each kind of bad input gives its message while the app stays usable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save as save_tensors
from streamlit.testing.v1 import AppTest

from app.core import models, pages, settings
from app.core.session import View
from app.core.traces import Entry, store
from app.topics import cards, model_map
from app.topics.router import bias_effect, moe_blocks
from model import kernels
from model.config import ModelArgs
from tests.app.apptest import APP, TIMEOUT, messages, start
from tracing.tables import to_csv_bytes

PAGES = [
    p.name for p in pages.PAGES if p.traced and p.name not in ("interventions", "attribution", "patching")
]  # those run the model again: tests/app/test_app_interventions.py, _attribution.py, _patching.py; the atlas: _atlas.py
REAL = ModelArgs.from_file(Path(__file__).resolve().parents[2] / "assets" / "configs" / "config_671B_hf.json")


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, app_checkpoint)


def plotly_charts(at: AppTest) -> list:
    return at.get("plotly_chart")


def open_cards(at: AppTest, page: str) -> AppTest:
    """Open the page's component cards: a topic page keeps them in an expander drawn when opened, the
    model map in its last tab; the anatomy page shows its card as it is."""
    if page == "model_map":
        at.session_state["model_map_tab"] = "The transformer block"
    elif page != "anatomy":
        at.session_state[f"{page}_cards"] = True
    return at.run()


def open_tab(at: AppTest, key: str, label: str) -> AppTest:
    """Open a page's tab (widgets.lazy_tabs draws only the open one)."""
    at.session_state[key] = label
    return at.run()


def shown_entry(at: AppTest) -> Entry:
    entry = store().get(at.session_state["trace_key"])
    assert entry is not None
    return entry


# --- pages -------------------------------------------------------------------------------------------------
def test_first_load_traces_the_default_prompt(app):
    assert not app.error, messages(app.error)
    entry = shown_entry(app)
    assert entry.trace.prompt == settings.DEFAULT_PROMPT and entry.trace.n_tokens > 10
    assert plotly_charts(app) and not app.latex  # the model map's plots; its block card waits in a tab
    assert any("Showing" in c.value and "tokens" in c.value for c in app.caption)
    assert open_cards(app, "model_map").latex and not app.exception


def test_the_first_element_fetches_the_plotting_code(app):
    """main.py sends, before it loads torch, a script asking the browser for Streamlit's plotly chart
    module; the file it names is in the installed Streamlit, so the chart finds it loaded."""
    from app.ui import prefetch

    name = prefetch.plotly_chunk()
    assert name is not None and (prefetch.CHUNKS / name).is_file(), "this Streamlit has no PlotlyChart module"
    first = app.get("html")[0].proto
    assert f'"./{name}"' in first.body and first.unsafe_allow_javascript


def test_sidebar_names_the_cpu_bfloat16_route_and_threads(app):
    assert kernels.describe()["cpu_products"] in messages(app.sidebar.caption)
    shown = messages(app.sidebar.caption)
    assert "CPU threads: 1 thread" in shown or "threads for products of at least" in shown  # as the app's thread has them


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_cards_and_plots(app, page):
    app.switch_page(f"views/{page}.py").run()
    assert not app.exception, [e.value for e in app.exception]
    assert not app.error, messages(app.error)
    if page != "export":
        assert len(plotly_charts(app)) >= 1, "the page shows no plot"
        open_cards(app, page)
        assert not app.exception, [e.value for e in app.exception]
        assert len(app.latex) >= 1, "the page shows no card equation"
        assert len(plotly_charts(app)) >= 1, "the page shows no plot"
        assert app.code, "the page shows no code excerpt"


# the tabs of the pages that keep their views in tabs, each with words of its figure's title (None: a table)
TABS = {
    "model_map": ("model_map_tab", {"Your prompt": "Next token", "Parameters per component": "", "Config": None}),
    "residual": (
        "residual_tab",
        {"Stream norm": "norm |x|", "Turn per block": "Cosine", "Update sizes": "update sizes", "Logit lens": "Logit lens"},
    ),
    "attention": (
        "attention_tab",
        {
            "Index scores": "index scores I",
            "Attention": "attention probabilities",
            "Indexer recall": "recall",
            "One query": "query",
        },
    ),
    "router": (
        "router_tab",
        {
            "Scores": "router scores",
            "Groups and weights": "group scores",
            "Correction bias": "correction bias",
            "Routed and shared": "routed vs shared",
            "Load across blocks": "Expert load",
            "Margins": "routing margin per position",
        },
    ),
}


@pytest.mark.parametrize("page", TABS)
def test_every_tab_draws_its_view(app, page):
    """The tabs draw only the open view: each one, opened, draws its figure (none is lost behind them)."""
    app.switch_page(f"views/{page}.py").run()
    key, views = TABS[page]
    for label, words in views.items():
        open_tab(app, key, label)
        assert not app.exception and not app.error, (label, [e.value for e in app.exception], messages(app.error))
        titles = [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in plotly_charts(app)]
        if words is None:
            assert app.dataframe, label
        else:
            assert titles and any(words in t for t in titles), (label, titles)


def test_every_card_on_the_anatomy_page(app):
    app.switch_page("views/anatomy.py").run()
    all_cards = cards.load_cards()
    for card_id, card in all_cards.items():
        app.button_group(key="anatomy_component").set_value(card_id).run()
        assert not app.exception, (card_id, [e.value for e in app.exception])
        assert [e.value.strip("$\n") for e in app.latex] == list(card.equations), card_id
        assert len(plotly_charts(app)) == 1, card_id
        excerpts = [cards.excerpt(anchor) for anchor in card.code]
        assert [c.value for c in app.code] == [e.text() for e in excerpts], card_id
    app.button_group(key="anatomy_component").set_value("all").run()
    assert not app.exception
    assert len(plotly_charts(app)) == len(all_cards)


@pytest.mark.parametrize("page", ["anatomy", "attention", "router", "residual"])
def test_switching_blocks(app, page):
    app.switch_page(f"views/{page}.py").run()
    cfg = shown_entry(app).trace.config
    for block in (cfg.n_layers - 1, 0):
        app.selectbox(key="block").set_value(block).run()
        assert not app.exception, (block, [e.value for e in app.exception])
        assert any(f"block {block}" in str(m.value) for m in app.markdown), block
    if page == "router" and not cfg.is_moe(0):
        assert "is dense (no router)" in messages(app.info)


def test_router_page_recomputes_the_traced_selection(app):
    """The bias comparison re-runs the group-limited top-k from the recorded scores: on the traced
    biased scores it must give exactly the experts the model chose."""
    trace = shown_entry(app).trace
    for block in moe_blocks(trace):
        effect = bias_effect(trace, block)
        assert effect is not None and effect.reproduced, block


def test_index_scores_mark_the_rarer_of_selected_and_dropped_keys(app):
    """Where most visible keys are selected (the default prompt is longer than index_topk, but not
    twice), the plot crosses the dropped keys instead of circling nearly every cell."""
    from app.topics import card_plots

    entry = shown_entry(app)
    n, k = entry.trace.n_tokens, entry.trace.config.index_topk
    for block in range(entry.trace.config.n_layers):
        fig = card_plots.index_scores(View(entry, block), block)
        marks = fig.data[-1]
        dropped = sum(max(0, t + 1 - k) for t in range(n))
        selected = sum(min(t + 1, k) for t in range(n))
        if dropped < selected:
            assert marks.name == "dropped key" and len(marks.x) == dropped, block
        else:
            assert marks.name == "selected key" and len(marks.x) == selected, block
    assert k < n, "the default prompt should be longer than index_topk, so the sparse attention prunes"


# --- export -----------------------------------------------------------------------------------------------
def test_export_offers_every_table_with_its_csv_header(app):
    app.switch_page("views/export.py").run()
    assert not app.exception
    entry = shown_entry(app)
    tables = entry.tables()
    shown = [c.value for c in app.code]
    for name, frame in tables.items():
        header = to_csv_bytes(frame).decode("utf-8").split("\r\n", 1)[0]
        assert header in shown, name
    router = to_csv_bytes(tables["router"]).decode("utf-8").split("\r\n", 1)[0]
    assert router == "block,position,token,expert,group,score,biased_score,group_chosen,selected,rank,weight"
    assert to_csv_bytes(tables["tokens"]).decode("utf-8").startswith("position,token_id,token,phase,generated\r\n0,")
    labels = [b.label for b in app.get("download_button")]
    assert labels.count("CSV") == len(tables) and labels.count("Parquet") == len(tables)
    assert "Trace file (.safetensors)" in labels
    assert entry.trace_bytes()[:8]  # the trace file the button serves


# --- bad input ----------------------------------------------------------------------------------------------
def trace_prompt(at: AppTest, prompt: str) -> AppTest:
    at.text_area(key="prompt").set_value(prompt)
    return at.button(key="run").click().run()


def test_missing_demo_says_how_to_get_one(monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV_CHECKPOINT, "demo")
    monkeypatch.setattr(models, "DEMO", tmp_path / "no-demo")
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert not at.exception
    assert "scripts/train_demo.py" in messages(at.error)
    assert "Nothing traced yet" in messages(at.info)  # the page says what to do instead


def test_empty_prompt_says_so_and_keeps_the_last_trace(app):
    before = app.session_state["trace_key"]
    trace_prompt(app, "   ")
    assert "The prompt is empty" in messages(app.error)
    assert app.session_state["trace_key"] == before and not app.exception
    trace_prompt(app, "The quick brown fox jumps over the lazy dog.")
    assert not app.error and shown_entry(app).trace.prompt == "The quick brown fox jumps over the lazy dog."
    app.switch_page("views/attention.py").run()
    assert not app.exception and plotly_charts(app)


def test_too_long_prompt_says_so(app):
    trace_prompt(app, "the quick brown fox " * 600)
    assert "The prompt is too long" in messages(app.error)
    assert not app.exception


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: tmp / "does-not-exist", "no such directory"),
        (lambda tmp: (tmp / "file.txt").write_text("x") and tmp / "file.txt", "is a file, not a checkpoint directory"),
        (lambda tmp: tmp, "no config.json here"),
        (lambda tmp: (tmp / "config.json").write_text("{not json") and tmp, "not a readable JSON config"),
        (
            lambda tmp: (tmp / "config.json").write_text(json.dumps(REAL.to_hf())) and tmp,
            "no model.safetensors.index.json",
        ),
    ],
)
def test_bad_checkpoint_directory_says_why(app, tmp_path, make, message):
    path = make(tmp_path)
    app.radio(key="source").set_value("dir").run()
    app.text_input(key="ckpt_dir").set_value(str(path)).run()
    assert "Checkpoint not loaded" in messages(app.error) and message in messages(app.error)
    assert not app.exception
    app.switch_page("views/residual.py").run()  # the last good trace is still there to look at
    assert not app.exception and plotly_charts(app)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"definitely not a safetensors file", "not a readable trace file"),
        (save_tensors({"x": torch.zeros(2)}), "format is None"),
    ],
)
def test_corrupt_trace_upload_says_why(app, data, message):
    app.radio(key="source").set_value("upload").run()
    app.file_uploader(key="upload").set_value(("broken.safetensors", data, "application/octet-stream")).run()
    assert "Trace file not opened" in messages(app.error) and message in messages(app.error)
    assert "broken.safetensors" in messages(app.error)
    assert not app.exception


def test_uploaded_trace_is_viewable_with_no_model(app, tmp_path, monkeypatch):
    data = shown_entry(app).trace_bytes()
    monkeypatch.setenv(settings.ENV_CHECKPOINT, str(tmp_path / "no-model-here"))
    at = AppTest.from_file(APP, default_timeout=TIMEOUT).run()
    assert "no such directory" in messages(at.error)
    at.radio(key="source").set_value("upload").run()
    at.file_uploader(key="upload").set_value(("mine.safetensors", data, "application/octet-stream")).run()
    assert not at.error and not at.exception
    assert at.session_state["trace_key"].source == "upload"
    for page in PAGES:
        at.switch_page(f"views/{page}.py").run()
        assert not at.exception, (page, [e.value for e in at.exception])
        if page != "export":
            assert plotly_charts(at) and open_cards(at, page).latex, page


# --- cards as data ------------------------------------------------------------------------------------------
def test_cards_cover_the_model_and_resolve_for_the_real_config():
    all_cards = cards.load_cards()
    assert set(all_cards) >= {
        "embedding",
        "block",
        "rmsnorm",
        "mla",
        "indexer",
        "sparse_mask",
        "mlp",
        "router",
        "experts",
        "head",
    }
    block = all_cards["block"]
    assert cards.shape_text(block.inputs[0].dims, REAL) == "[B batch, T positions, 7168 d]"
    assert cards.shape_here(block.inputs[0].dims, REAL, 5) == [1, 5, 7168]
    router = all_cards["router"]
    assert cards.shape_text(router.outputs[0].dims, REAL) == "[N tokens (B·T), 256 experts]"
    values = cards.facts_for(REAL, 3, 10)
    assert values["yarn"].startswith("on:") and values["block_kind"] == "an MoE block"
    for card in all_cards.values():
        for spec in card.inputs + card.params + card.outputs:
            cards.shape_text(spec.dims, REAL)
            assert all(n > 0 for n in cards.shape_here(spec.dims, REAL, 7)), (card.id, spec.symbol)
        assert "{{" not in "".join(cards.fill(f, values) for f in (*card.facts, card.explanation)), card.id


def test_parameter_counts_match_the_model():
    from model import TINY
    from model.params import count_params

    for args in (TINY, TINY.replace(n_dense_layers=0), TINY.replace(n_dense_layers=3)):
        want = count_params(args)
        got = model_map.param_counts(args)
        assert got["total_params"] == want["total_params"] and got["activated_params"] == want["activated_params"]
        assert got["components"] == want["components"]
        assert model_map.params_by_block(args)["params"].sum() == sum(want["per_layer"])
    assert model_map.param_counts(REAL)["total_params"] == 671_877_944_064  # README's figure, without the MTP layer


def test_code_excerpts_are_the_current_source():
    for card in cards.load_cards().values():
        for anchor in card.code:
            excerpt = cards.excerpt(anchor)
            lines = (Path(cards.REPO) / excerpt.path).read_text().splitlines()
            for first, chunk in excerpt.pieces:
                for offset, line in enumerate(chunk.splitlines()):
                    assert lines[first - 1 + offset].strip() == line.strip(), (anchor.ref, first + offset)


def fake_trace(args: ModelArgs, n_tokens: int, seed: int = 0):
    """A consistent random trace of any config (what the 671B gives, without running it): the router's
    and the indexer's selections are computed from the recorded scores as the model computes them."""
    from model.moe import RouterRule, select_experts
    from tracing.sites import DEFAULT_PATTERNS, select, site_shape, site_shapes
    from tracing.trace import Trace

    g = torch.Generator().manual_seed(seed)
    shapes = site_shapes(args)
    tensors = {"tokens": torch.randint(0, args.vocab_size, (n_tokens,), generator=g)}
    causal = torch.ones(n_tokens, n_tokens, dtype=torch.bool).tril()
    for name in select(args, list(DEFAULT_PATTERNS)):
        legend, dtype = shapes[name]
        shape = site_shape(args, name, legend, n_tokens)
        if dtype == torch.float32:
            tensors[name] = torch.randn(shape, generator=g)
    top = site_shape(args, "next.topk_indices", shapes["next.topk_indices"][0], n_tokens)  # each position's top tokens
    tensors["next.topk_indices"] = torch.randint(0, args.vocab_size, top, generator=g)
    tensors["next.topk_probs"] = torch.rand(top, generator=g).sort(-1, descending=True).values
    for i in range(args.n_layers):
        scores = torch.randn(n_tokens, n_tokens, generator=g).masked_fill(~causal, float("-inf"))
        k = min(args.index_topk, n_tokens)
        top = scores.topk(k, dim=-1)
        tensors[f"layers.{i}.attn.indexer.scores"] = scores
        tensors[f"layers.{i}.attn.indexer.topk_indices"] = top.indices.masked_fill(top.values == float("-inf"), -1)
        tensors[f"layers.{i}.attn.probs_mean"] = (
            torch.randn(n_tokens, n_tokens, generator=g).masked_fill(~causal, float("-inf")).softmax(-1)
        )
        tensors[f"layers.{i}.attn.indexer.recall"] = torch.rand(n_tokens, generator=g)
        tensors[f"layers.{i}.logit_lens.topk_indices"] = torch.randint(0, args.vocab_size, (n_tokens, 5), generator=g)
        tensors[f"layers.{i}.logit_lens.topk_probs"] = torch.rand(n_tokens, 5, generator=g).sort(-1, descending=True).values
        if args.is_moe(i):
            s = torch.rand(n_tokens, args.n_routed_experts, generator=g)
            b = torch.rand(args.n_routed_experts, generator=g) * 0.05
            routed = select_experts(s, b, RouterRule.of(args))
            for stage in ("scores", "biased_scores", "group_scores", "groups", "topk_indices", "topk_weights"):
                tensors[f"layers.{i}.ffn.gate.{stage}"] = getattr(routed, stage)
    trace = Trace(tensors, args, [f"t{j}" for j in range(n_tokens)], "a trace of the real width")
    trace.validate()
    return trace


def test_an_uploaded_trace_of_the_real_width_renders(app):
    """The 671B's widths (7168 d, 256 experts in 8 groups, 128 heads), four blocks of them."""
    trace = fake_trace(REAL.replace(n_layers=4), 40)
    app.radio(key="source").set_value("upload").run()
    app.file_uploader(key="upload").set_value(("real.safetensors", trace.to_bytes(), "application/octet-stream")).run()
    assert not app.error, messages(app.error)
    for page in PAGES:
        app.switch_page(f"views/{page}.py").run()
        assert not app.exception, (page, [e.value for e in app.exception])
    app.switch_page("views/router.py").run()
    app.selectbox(key="block").set_value(3).run()
    open_tab(app, "router_tab", "Correction bias")
    assert not app.exception and "matches the trace" in " ".join(str(m.value) for m in app.get("metric"))


def test_the_indexer_quality_table_on_a_prompt_the_indexer_prunes(app):
    long = " ".join(["It is a truth universally acknowledged, that a single man in possession of a good fortune."] * 5)
    app.text_area(key="prompt").set_value(long).run()
    app.button(key="run").click().run()
    app.switch_page("views/attention.py").run()
    open_tab(app, "attention_tab", "Indexer recall")
    assert not app.exception and not app.error, messages(app.error)
    quality = next(d.value for d in app.dataframe if "kl" in d.value.columns)
    assert (
        list(quality.columns) == ["block", "recall", "kl", "overlap_prev"]
        and len(quality) == shown_entry(app).trace.config.n_layers
    )
    assert (quality["kl"] > 0).all() and quality["overlap_prev"].iloc[1:].between(0, 1).all()
