"""The interventions page, run headless with AppTest on the bundled demo (or the tiny dev checkpoint
while assets/demo is absent): it renders, an ablation runs and shows the diff summary and plots, the
ablated expert is never chosen in the intervened trace, ablated heads and zeroed experts give the
command line's trace, and bad input gives st.error, not a crash."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from streamlit.testing.v1 import AppTest

from app.core.models import open_model
from app.core.traces import Entry, describe_interventions, record_patterns, store
from app.topics import attribution
from tests.app.apptest import messages, start
from tracing.analyses.attribution import AttributionRequest
from tracing.analyses.graph import Graph, GraphRun
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import AblateExperts, AblateHeads, IndexTopK, NoGateBias, ZeroExperts
from tracing.cli.loading import REPO
from tracing.runner import trace_tokens

PAGE = "views/interventions.py"


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, app_checkpoint, PAGE)


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.get("metric")}


def chart_titles(at: AppTest) -> list[str]:
    return [spec.get("layout", {}).get("title", {}).get("text", "") for spec in chart_specs(at)]


def chart_specs(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def chart(at: AppTest, title: str) -> dict:
    return chart_specs(at)[chart_titles(at).index(title)]


def run(at: AppTest) -> AppTest:
    at.button(key="iv_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def baseline_entry(at: AppTest) -> Entry:
    entry = store().get(at.session_state["trace_key"].plain)
    assert entry is not None
    return entry


def intervened_entry(at: AppTest) -> Entry:
    result = at.session_state["iv_result"]
    key = replace(baseline_entry(at).key, variant=describe_interventions(from_spec(result["spec"])))
    entry = store().get(key)
    assert entry is not None
    return entry


def busiest_expert(base: Entry, block: int) -> int:
    """The routed expert the baseline sends the most tokens to in this block."""
    chosen = base.trace[f"layers.{block}.ffn.gate.topk_indices"]
    return int(torch.bincount(chosen.flatten(), minlength=base.trace.config.n_routed_experts).argmax())


def as_the_cli_runs(base: Entry, spec: dict) -> dict[str, torch.Tensor]:
    """The tensors ``python -m tracing run`` records for the baseline's tokens with these interventions
    (its flags' spec), the app's sites recorded."""
    model = open_model(base.key.checkpoint, base.key.dtype).loaded.model
    ids = base.trace.token_ids
    return trace_tokens(model, ids, record=record_patterns(base.trace.config, len(ids)), interventions=from_spec(spec)).tensors


def assert_same_tensors(app_tensors: dict[str, torch.Tensor], cli_tensors: dict[str, torch.Tensor]) -> None:
    assert set(app_tensors) == set(cli_tensors)
    differ = [name for name in cli_tensors if not torch.equal(app_tensors[name], cli_tensors[name])]
    assert not differ, differ


def pick(at: AppTest, block_key: str, block: int, prefix: str, ids: list[int]) -> None:
    at.selectbox(key=block_key).set_value(block).run()
    at.multiselect(key=f"{prefix}{block}").set_value(ids).run()


def test_page_renders_with_controls_and_no_result_yet(app):
    assert not app.error, messages(app.error)
    assert any("Interventions" in str(h.value) for h in app.header)
    cfg = baseline_entry(app).trace.config
    assert app.selectbox(key="iv_block").value >= cfg.n_dense_layers  # a MoE block
    assert "Busiest in block" in messages(app.caption)
    assert not app.get("metric")  # nothing run yet
    run(app)  # nothing chosen: a warning, no crash
    assert "Nothing to change" in messages(app.warning)
    assert "iv_result" not in app.session_state


def test_ablating_the_busiest_expert(app):
    base = baseline_entry(app)
    block = app.selectbox(key="iv_block").value
    busiest = busiest_expert(base, block)
    app.multiselect(key=f"iv_experts_{block}").set_value([busiest]).run()
    run(app)
    assert not app.error, messages(app.error)
    shown = metrics(app)
    assert shown["First block that changed"] == f"block {block}"
    assert shown["Expert choices changed"].split(" of ")[0] != "0"
    assert "Next-token KL" in shown and "Top next token" in shown
    titles = chart_titles(app)
    assert any("residual stream moved" in t for t in titles), titles
    assert any("block by block" in t for t in titles), titles
    assert any("tokens per expert" in t for t in titles), titles
    assert any("Logit lens" in t for t in titles), titles
    assert len(app.get("plotly_chart")) >= 6
    # the intervened trace never routes to the ablated expert; blocks before it are untouched
    iv = intervened_entry(app).trace
    assert busiest not in iv[f"layers.{block}.ffn.gate.topk_indices"].flatten().tolist()
    assert iv.extra["interventions"] == [f"ablate {block}:{busiest}"]
    assert torch.equal(iv[f"layers.{block}.resid_mid"], base.trace[f"layers.{block}.resid_mid"])
    # the diff tables, each with its CSV
    labels = [b.label for b in app.get("download_button")]
    assert labels.count("CSV") >= 4 and "All diff tables (CSV, zip)" in labels
    assert app.dataframe
    # the intervened trace in the other pages, then back
    app.button(key="iv_show").click().run()
    assert app.session_state["trace_key"] == intervened_entry(app).key
    for page in ("views/router.py", "views/residual.py", "views/attention.py"):
        app.switch_page(page).run()
        assert not app.exception, (page, [e.value for e in app.exception])
    app.switch_page(PAGE).run()
    assert not app.exception and metrics(app)["First block that changed"] == f"block {block}"
    app.button(key="iv_show_base").click().run()
    assert app.session_state["trace_key"] == base.key


def test_router_and_attention_toggles(app):
    app.toggle(key="iv_no_bias").set_value(True).run()
    app.radio(key="iv_attention").set_value("dense").run()
    run(app)
    assert not app.error, messages(app.error)
    iv = intervened_entry(app).trace
    assert iv.extra["interventions"] == [NoGateBias().describe(), IndexTopK.dense().describe()]
    assert iv.config.index_topk == iv.config.max_seq_len and "First block that changed" in metrics(app)
    # the bias removed in the last block only: a new run, cached beside the first
    base = baseline_entry(app).trace
    last = base.config.n_layers - 1
    app.multiselect(key="iv_no_bias_blocks").set_value([last]).run()
    app.radio(key="iv_attention").set_value("model").run()
    run(app)
    iv = intervened_entry(app)
    assert iv.origin.endswith(f"no correction bias in blocks {last}")
    name = f"layers.{last}.ffn.gate.topk_indices"
    moved = not torch.equal(iv.trace[name].sort(-1).values, base[name].sort(-1).values)
    assert metrics(app)["First block that changed"] == (f"block {last}" if moved else "none")
    # another index_topk: fewer keys than the prompt has, so block 0's attention changes
    app.toggle(key="iv_no_bias").set_value(False).run()
    assert app.multiselect(key="iv_no_bias_blocks").disabled
    app.radio(key="iv_attention").set_value("topk").run()
    app.number_input(key="iv_topk").set_value(2).run()
    run(app)
    assert intervened_entry(app).trace.extra["interventions"] == ["index_topk=2"]
    assert intervened_entry(app).trace.config.index_topk == 2
    assert metrics(app)["First block that changed"] == "block 0"


def test_bad_ablations_give_an_error_and_the_page_stays_usable(app):
    cfg = baseline_entry(app).trace.config
    block = app.selectbox(key="iv_block").value
    too_many = list(range(cfg.n_routed_experts - cfg.n_activated_experts + 1))  # fewer than k would remain
    app.multiselect(key=f"iv_experts_{block}").set_value(too_many).run()
    run(app)
    assert "Not run" in messages(app.error) and "fewer than k" in messages(app.error)
    assert "iv_result" not in app.session_state
    app.multiselect(key=f"iv_experts_{block}").set_value([]).run()
    for text, message in (("1-3", "expected LAYER:EXPERT"), (f"0:{cfg.n_routed_experts}", "")):
        app.text_input(key="iv_ablate_text").set_value(text).run()
        run(app)
        assert "Not run" in messages(app.error) and message in messages(app.error), text
    app.text_input(key="iv_ablate_text").set_value(f"{block}:1").run()
    run(app)
    assert not app.error and metrics(app)
    assert 1 not in intervened_entry(app).trace[f"layers.{block}.ffn.gate.topk_indices"].flatten().tolist()


def test_clear_resets_the_choices(app):
    block = app.selectbox(key="iv_block").value
    app.multiselect(key=f"iv_experts_{block}").set_value([0, 1]).run()
    app.radio(key="iv_attention").set_value("dense").run()
    app.button(key="iv_clear").click().run()
    assert not app.exception
    assert app.multiselect(key=f"iv_experts_{block}").value == []
    assert app.radio(key="iv_attention").value == "model"


def test_an_uploaded_trace_says_interventions_need_a_model(app):
    data = baseline_entry(app).trace_bytes()
    app.radio(key="source").set_value("upload").run()
    app.file_uploader(key="upload").set_value(("mine.safetensors", data, "application/octet-stream")).run()
    assert not app.exception and not app.error
    assert "a trace file holds no model" in messages(app.info)
    assert not app.get("metric")


def test_the_store_keys_tell_interventions_apart():
    runs = [
        [AblateExperts({1: (3,)})],
        [AblateExperts({1: (4,)})],
        [NoGateBias()],
        [NoGateBias((1,))],
        [IndexTopK.dense()],
        [IndexTopK(4)],
        [AblateExperts({1: (3,)}), IndexTopK(4)],
        [ZeroExperts({1: (3,)})],
        [ZeroExperts({1: (4,)})],
        [ZeroExperts({1: (3,), 2: (3,)})],
        [AblateHeads({1: (3,)})],
        [AblateHeads({1: (3, 4)})],
        [AblateHeads({2: (3,)})],
        [AblateHeads({1: (3,)}), ZeroExperts({1: (3,)})],
    ]
    keys = {describe_interventions(r) for r in runs}
    assert len(keys) == len(runs)


def test_an_evicted_intervened_trace_is_made_again(app):
    """The store may drop the intervened trace (other sessions filled it): the other pages fall back to
    its baseline and this page runs the intervention again from the session's small spec."""
    block = app.selectbox(key="iv_block").value
    app.multiselect(key=f"iv_experts_{block}").set_value([0]).run()
    run(app)
    key = intervened_entry(app).key
    app.button(key="iv_show").click().run()
    assert app.session_state["trace_key"] == key
    traces = store()
    with traces._lock:
        del traces._entries[key]
    app.switch_page("views/router.py").run()
    assert not app.exception and app.session_state["trace_key"] == key.plain
    app.switch_page(PAGE).run()
    assert not app.exception and not app.error and metrics(app)
    assert traces.get(key) is not None


def test_ablating_heads_in_two_blocks_runs_as_the_command_line(app):
    base = baseline_entry(app)
    cfg = base.trace.config
    last, top = cfg.n_layers - 1, cfg.n_heads - 1
    pick(app, "iv_head_block", 0, "iv_heads_", [top, 0])
    pick(app, "iv_head_block", last, "iv_heads_", [1])
    assert app.session_state["iv_heads_0"] == [top, 0]  # the first block's picks kept while another shows
    flag = f"0:0,0:{top},{last}:1"
    assert f"--ablate-heads {flag}" in messages(app.caption)
    run(app)
    assert not app.error, messages(app.error)
    iv = intervened_entry(app).trace
    assert iv.extra["interventions"] == [AblateHeads({0: (0, top), last: (1,)}).describe()]
    assert_same_tensors(iv.tensors, as_the_cli_runs(base, {"ablate_heads": flag}))
    probs = iv["layers.0.attn.probs"]  # (T, H, S)
    assert not probs[:, [0, top]].any() and probs[:, 1].any()
    assert not torch.equal(iv["layers.0.resid_mid"], base.trace["layers.0.resid_mid"])
    shown = metrics(app)
    assert shown["First block that changed"] == "block 0"
    # the last position's top token: its logit in the intervened run, and how far it moved
    top_id = int(base.trace["logits.last"].argmax())
    logit = next(m for m in app.get("metric") if m.label.startswith("Logit of "))
    assert logit.value == f"{float(iv['logits.last'][top_id]):.3f}"
    assert logit.proto.delta == f"{float(iv['logits.last'][top_id] - base.trace['logits.last'][top_id]):+.3f}"


def test_zeroing_an_expert_keeps_the_routing_and_runs_as_the_command_line(app):
    base = baseline_entry(app)
    cfg = base.trace.config
    block = app.selectbox(key="iv_zero_block").value
    assert block >= cfg.n_dense_layers  # experts of the MoE blocks only; heads of every block
    assert len(app.selectbox(key="iv_zero_block").options) == cfg.n_layers - cfg.n_dense_layers
    assert len(app.selectbox(key="iv_head_block").options) == cfg.n_layers
    busiest = busiest_expert(base, block)
    app.multiselect(key=f"iv_zeroed_{block}").set_value([busiest]).run()
    run(app)
    assert not app.error, messages(app.error)
    zeroed = intervened_entry(app)
    iv = zeroed.trace
    assert iv.extra["interventions"] == [f"zero {block}:{busiest}"]
    assert_same_tensors(iv.tensors, as_the_cli_runs(base, {"zero_experts": f"{block}:{busiest}"}))
    # still chosen, with the same weights: only what it writes is gone
    for site in ("gate.topk_indices", "gate.topk_weights"):
        assert torch.equal(iv[f"layers.{block}.ffn.{site}"], base.trace[f"layers.{block}.ffn.{site}"]), site
    assert not torch.equal(iv[f"layers.{block}.resid_post"], base.trace[f"layers.{block}.resid_post"])
    assert metrics(app)["First block that changed"] == f"block {block}"
    load = chart(app, f"Block {block}: tokens per expert, baseline and intervened")
    assert [d["x"] for d in load["data"] if d.get("name", "").startswith("zeroed")] == [[busiest]]
    # ablating the same expert instead routes around it: another run, cached beside this one
    app.multiselect(key=f"iv_zeroed_{block}").set_value([]).run()
    app.multiselect(key=f"iv_experts_{block}").set_value([busiest]).run()
    run(app)
    ablated = intervened_entry(app)
    assert ablated.key != zeroed.key and store().get(zeroed.key) is zeroed
    assert busiest not in ablated.trace[f"layers.{block}.ffn.gate.topk_indices"].flatten().tolist()


@pytest.mark.parametrize(
    ("key", "text", "message"),
    [
        ("iv_head_text", "1-2", "expected LAYER:HEAD"),
        ("iv_head_text", "99:0", "blocks are numbered"),
        ("iv_head_text", "0:99", "heads are numbered"),
        ("iv_zero_text", "0:1", "not a MoE block"),
        ("iv_zero_text", "{moe}:999", "experts are numbered"),
        ("iv_zero_text", ",", "no LAYER:EXPERT"),
    ],
)
def test_bad_heads_and_zeroed_experts_give_one_error(app, key, text, message):
    cfg = baseline_entry(app).trace.config
    app.text_input(key=key).set_value(text.format(moe=cfg.n_dense_layers)).run()
    run(app)
    assert len(app.error) == 1, messages(app.error)
    assert "Not run" in messages(app.error) and message in messages(app.error)
    assert "iv_result" not in app.session_state and not app.get("metric")
    app.text_input(key=key).set_value("").run()  # the page stays usable
    app.multiselect(key=f"iv_heads_{app.selectbox(key='iv_head_block').value}").set_value([0]).run()
    run(app)
    assert not app.error and metrics(app)


@pytest.mark.parametrize(("key", "kind"), [("ablate_heads", "attn"), ("zero_experts", "ffn")])
def test_the_attribution_page_removes_its_strongest_part_in_one_click(app, key, kind):
    """The causal check from the Attribution page: its button opens this page with only that part picked, run."""
    cfg = baseline_entry(app).trace.config
    block = cfg.n_layers - 1  # a MoE block
    app.switch_page("views/attribution.py").run()
    app.selectbox(key="attr_block").set_value(block).run()
    assert not app.exception and not app.error, messages(app.error)
    shown = AttributionRequest(app.selectbox(key="attr_position").value, app.selectbox(key="attr_target").value)
    plain = app.session_state["trace_key"].plain
    attributed = store().get(replace(plain, variant=attribution.variant(shown, False)))
    parts = attributed.trace.site(block, f"{kind}.attribution")  # (H,) or (E + shared,)
    strongest = int(parts[: cfg.n_routed_experts].abs().argmax()) if kind == "ffn" else int(parts.abs().argmax())
    app.button(key=f"attr_remove_{key}").click().run()
    assert not app.exception and not app.error, messages(app.error)
    assert any("Interventions" in str(h.value) for h in app.header)
    spec = app.session_state["iv_result"]["spec"]
    assert spec[key] == {block: [strongest]} and spec["at"] == str(shown.position)  # at the attributed position only
    assert [k for k, v in spec.items() if v and k != "at"] == [key]
    assert app.text_input(key="iv_at").value == str(shown.position)
    assert any(label.startswith("Logit of ") for label in metrics(app))
    picks = "iv_heads_" if key == "ablate_heads" else "iv_zeroed_"
    assert app.multiselect(key=f"{picks}{block}").value == [strongest]


def test_removals_at_positions_leave_the_positions_before_alone(app):
    base = baseline_entry(app).trace
    at = base.n_tokens - 3
    app.multiselect(key=f"iv_heads_{app.selectbox(key='iv_head_block').value}").set_value([0]).run()
    app.text_input(key="iv_at").set_value(f"{at}:").run()
    run(app)
    assert not app.error, messages(app.error)
    trace = intervened_entry(app).trace
    assert app.session_state["iv_result"]["spec"]["at"] == f"{at}:"
    assert trace.extra["interventions"] == [f"ablate heads 0:0 at positions {at}:"]
    assert torch.equal(trace["layers.0.resid_post"][:at], base["layers.0.resid_post"][:at])
    assert not torch.equal(trace["layers.0.resid_post"][at:], base["layers.0.resid_post"][at:])
    app.text_input(key="iv_at").set_value("9:2").run()
    run(app)
    assert "holds no position" in messages(app.error)


def test_an_uploaded_graph_runs_as_the_command_line(app):
    """The steering example uploaded with its constants: the intervened trace is the one its graph makes
    outside the app."""
    examples = REPO / "docs" / "examples"
    files = [
        (name, (examples / name).read_bytes(), "application/octet-stream") for name in ("steering.json", "steering.safetensors")
    ]
    app.file_uploader(key="iv_graph").set_value(files)
    run(app)
    assert not app.error, messages(app.error)
    base = baseline_entry(app)
    graph = Graph.load(examples / "steering.json")
    assert app.session_state["iv_result"]["graph"] == graph.fingerprint()
    key = replace(base.key, variant=("graph", graph.fingerprint()))
    iv = store().get(key)
    assert iv is not None and iv.trace.extra["graph"]["ops"] == graph.to_dict()["ops"]
    model = open_model(base.key.checkpoint, base.key.dtype).loaded.model
    ids = base.trace.token_ids
    want = trace_tokens(model, ids, record=record_patterns(base.trace.config, len(ids)), interventions=[GraphRun(graph)])
    assert_same_tensors(iv.trace.tensors, want.tensors)
    assert metrics(app)  # the comparison is shown
