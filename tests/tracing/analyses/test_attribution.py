"""Direct logit attribution: the parts add up to the model's own logit, per block the heads to the
attention update and the experts to the FFN update, and the command line takes and refuses targets."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from model import TINY, fp8
from model.checkpoint import load_model
from model.moe import MoE
from model.synthetic import SyntheticSource
from tracing.analyses.attribution import AttributionRequest, expert_lens, removable
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import AblateHeads, IndexTopK, ZeroExperts
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.runner import trace_tokens
from tracing.sites import select
from tracing.tables.frames import ATTRIBUTION_PARTS, attribution_table, expert_lens_table, tables
from tracing.tokenizer import Tokenizer
from tracing.trace import Trace

DEMO = Path(__file__).resolve().parents[3] / "assets" / "demo"
needs_demo = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")
IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3]
UPDATES = "layers.*.attn_out,layers.*.ffn_out,layers.*.ffn.routed_out,layers.*.ffn.shared_out"
CAUSAL_PROMPTS = (  # the causal check's (also scripts/bench_attribution.py --causal)
    "The capital of France is",
    "Once upon a time there was a",
    "The quick brown fox jumps over the",
    "In the morning I drink a cup of",
    "Water boils at one hundred degrees",
    "She opened the door and saw",
    "The model reads the prompt and",
    "Two plus two equals",
    "The sun rises in the",
    "A mixture of experts routes each token to",
)


@pytest.fixture(scope="module")
def demo_model():
    return load_model(DEMO)


def _attributed(model, ids, request, interventions=()):
    """A trace with the attribution and the updates it splits, and, seen by hooks of the test's own,
    the final stream and each block's ``wo`` input at the attributed position."""
    seen: dict[str, torch.Tensor] = {}
    t = len(ids) - 1 if request.position is None else request.position
    handles = [model.norm.register_forward_hook(lambda m, i, o: seen.__setitem__("stream", i[0][0, t].float()))]
    for n, block in enumerate(model.layers):
        handles.append(block.attn.wo.register_forward_hook(lambda m, i, o, n=n: seen.__setitem__(n, i[0][0, t])))
    try:
        trace = trace_tokens(model, ids, record=f"default,{UPDATES}", attribution=request, interventions=interventions)
    finally:
        for handle in handles:
            handle.remove()
    return trace, seen, t


def _direction(model, trace, stream):
    """d logit / d stream with the final norm's scale frozen: W_head[target] (- W_head[contrast]) * gamma / rms."""
    info = trace.extra["attribution"]
    weight = model.head.weight.float()
    direction = weight[info["target"]] - (0 if info["contrast"] is None else weight[info["contrast"]])
    return direction * model.norm.weight.float() * torch.rsqrt(stream.pow(2).mean() + model.norm.eps)


def _wo_product(wo, x):
    """wo's product in float32 from its FP8-rounded input and dequantised weight, before the bfloat16 rounding."""
    if wo.scale is None:
        return wo.weight.float() @ x.float()
    return fp8.weight_dequant(wo.weight, wo.scale) @ fp8.dequant(*fp8.act_quant(x[None], wo.scale_fmt))[0]


def _parts(trace):
    names = ["attribution.embed", *(n for n in trace.tensors if n.endswith(".attribution"))]
    return torch.cat([trace[n].double() for n in names])


def _check(model, ids, request, interventions=()):
    """Every sum the attribution promises, and the heads' sources: exactly 0 for keys not selected;
    returns (|rest| share, worst relative sum error)."""
    trace, seen, t = _attributed(model, ids, request, interventions)
    parts = _parts(trace)
    total, rest = float(trace["attribution.total"][0]), float(trace["attribution.rest"][0])
    magnitude = float(parts.abs().sum())
    assert abs(total - float(parts.sum()) - rest) <= 1e-5 * magnitude
    assert abs(rest) <= 0.01 * magnitude
    u = _direction(model, trace, seen["stream"]).double()
    worst = 0.0
    for i, block in enumerate(model.layers):
        heads = trace.site(i, "attn.attribution").double()
        assert heads.shape == (model.args.n_heads,)
        attn = float(_wo_product(block.attn.wo, seen[i]).double() @ u)  # the attention update's float32 part
        error = abs(float(heads.sum()) - attn) / max(abs(attn), 1e-12)
        assert error <= 1e-4, (i, float(heads.sum()), attn)
        worst = max(worst, error)
        sources, remainder = trace.site(i, "attn.attribution_src").double(), trace.site(i, "attn.attribution_src_rest").double()
        assert sources.shape == (model.args.n_heads, len(ids)) and remainder.shape == (model.args.n_heads,)
        assert torch.allclose(sources.sum(-1) + remainder, heads, rtol=1e-5, atol=1e-6 * float(heads.abs().max()))
        selected = set(trace.site(i, "attn.indexer.topk_indices")[t].tolist()) - {-1}
        dropped = [s for s in range(len(ids)) if s not in selected]  # not selected, or after the position
        assert not sources[:, dropped].any(), (i, dropped)  # exactly 0
        assert sources[:, sorted(selected)].any()
        recorded = trace.site(i, "attn_out")[t].double()  # the same update, rounded to bfloat16
        assert abs(float(recorded @ u) - attn) <= 2**-8 * float((recorded * u).abs().sum())
        ffn = trace.site(i, "ffn.attribution").double()
        if isinstance(block.ffn, MoE):
            chosen = trace.site(i, "ffn.gate.topk_indices")[t]
            assert ffn.shape == (model.args.n_routed_experts + 1,)
            assert set(torch.nonzero(ffn[:-1]).flatten().tolist()) <= set(chosen.tolist())
            update = trace.site(i, "ffn.routed_out")[t].double() + trace.site(i, "ffn.shared_out")[t].double()
            part = float(update @ u)  # the FFN update's float32 part, before its bfloat16 rounding
            error = abs(float(ffn.sum()) - part) / max(abs(part), 1e-12)
            assert error <= 1e-4, (i, float(ffn.sum()), part)
            worst = max(worst, error)
        else:
            assert ffn.shape == (1,)
            part = float(trace.site(i, "ffn_out")[t].double() @ u)
            assert abs(float(ffn[0]) - part) <= 1e-5 * abs(part) + 1e-7
        recorded = trace.site(i, "ffn_out")[t].double()
        assert abs(float(recorded @ u) - part) <= 2**-8 * float((recorded * u).abs().sum())
    return trace, abs(rest) / magnitude, worst


def test_the_parts_add_up_on_the_tiny_model(tiny_model):
    trace, share, worst = _check(tiny_model, IDS, AttributionRequest())
    info = trace.extra["attribution"]
    assert info == {"position": len(IDS) - 1, "target": int(trace["next.topk_indices"][-1, 0]), "contrast": None}
    assert float(trace["attribution.total"][0]) == float(trace["logits.last"][info["target"]])  # the model's own logit
    _, share, worst = _check(tiny_model, IDS, AttributionRequest(target=7, contrast=9))
    logits = trace["logits.last"]
    again = trace_tokens(tiny_model, IDS, attribution=AttributionRequest(target=7, contrast=9))
    assert float(again["attribution.total"][0]) == pytest.approx(float(logits[7] - logits[9]), abs=1e-6)
    earlier, _, _ = _check(tiny_model, IDS, AttributionRequest(position=4))
    assert earlier.extra["attribution"]["target"] == int(earlier["next.topk_indices"][4, 0])


@pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")
def test_the_parts_add_up_on_the_demo(demo_model):
    tok = Tokenizer(DEMO)
    for prompt in ("The capital of France is", "Sparse attention lets each query read a few keys, so that"):
        ids = tok.encode(prompt)
        trace, share, worst = _check(demo_model, ids, AttributionRequest())
        target = trace.extra["attribution"]["target"]
        assert float(trace["attribution.total"][0]) == float(trace["logits.last"][target])
        contrast = int(trace["next.topk_indices"][-1, 1])
        _check(demo_model, ids, AttributionRequest(position=2, target=target, contrast=contrast))
        sparse, _, _ = _check(demo_model, ids, AttributionRequest(), [IndexTopK(4)])  # the indexer drops keys
        assert (sparse.site(1, "attn.attribution_src")[:, :-1] == 0).sum() >= 4 * (len(ids) - 5)


def test_the_table_has_a_row_per_part_and_is_exported(tiny_model):
    trace = trace_tokens(tiny_model, IDS, attribution=AttributionRequest())
    table = attribution_table(trace)
    assert "attribution" in tables(trace)
    args = tiny_model.args
    kinds = table["kind"].value_counts().to_dict()
    n_moe = args.n_layers - args.n_dense_layers
    sources = sum(int(trace.site(i, "attn.attribution_src").count_nonzero()) for i in range(args.n_layers))
    assert kinds == {
        "embed": 1,
        "head": args.n_layers * args.n_heads,
        "source": sources,
        "source_rest": args.n_layers * args.n_heads,
        "expert": n_moe * args.n_activated_experts,
        "shared": n_moe,
        "mlp": args.n_dense_layers,
        "rest": 1,
        "dropped keys": args.n_layers * args.n_heads,
    }
    parts = table[table["kind"].isin(ATTRIBUTION_PARTS)]
    assert parts["share"].sum() == pytest.approx(1.0)
    assert parts["value"].sum() + table["value"].iloc[-1] == pytest.approx(float(trace["attribution.total"][0]), abs=1e-5)
    split = table[table["kind"].isin(("source", "source_rest"))].groupby(["block", "index"])["value"].sum()
    heads = table[table["kind"] == "head"].set_index(["block", "index"])["value"]
    assert (split - heads).abs().max() <= 1e-5 * heads.abs().max()  # each head's sources and remainder make the head
    rows = table[table["kind"] == "source"]
    t = trace.extra["attribution"]["position"]
    for (block, _), keys in rows.groupby(["block", "index"])["source"]:
        assert set(keys) <= set(trace.site(block, "attn.indexer.topk_indices")[t].tolist())  # dropped keys: no row
    assert list(rows["source_token"]) == [trace.tokens[s] for s in rows["source"]]


def test_all_leaves_the_attribution_out_and_naming_it_uses_the_defaults(tiny_model):
    assert not [n for n in select(tiny_model.args, "all") if "attribution" in n]
    trace = trace_tokens(tiny_model, IDS, record="attribution.*")
    assert sorted(trace.tensors) == ["attribution.embed", "attribution.rest", "attribution.total", "tokens"]
    assert trace.extra["attribution"]["position"] == len(IDS) - 1


def _run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_the_command_line_attributes(tmp_path, capsys, tiny_checkpoint):
    out = tmp_path / "t.safetensors"
    base = ("run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ",".join(map(str, IDS)), "--out", str(out))
    code, err = _run(capsys, *base, "--attribute", "--position", "3", "--target", "7", "--contrast", "9", "--csv", str(tmp_path))
    assert code == 0, err
    trace = Trace.load(out)
    assert trace.extra["attribution"] == {"position": 3, "target": 7, "contrast": 9}
    assert trace["attribution.total"].shape == (1,) and trace.site(2, "ffn.attribution").shape == (17,)
    assert (tmp_path / "attribution.csv").is_file() and (tmp_path / "expert_lens.csv").is_file()
    flags = ("--attribute", "--prefill", "6", "--generate", "2", "--record", "default,flow", "--parquet")
    code, err = _run(capsys, *base, *flags, "--csv", str(tmp_path))
    assert code == 0, err
    trace = Trace.load(out)
    assert trace.extra["attribution"]["position"] == 13 and trace.site(1, "attn.flow").shape == (14, 14)
    assert {"attribution.parquet", "expert_lens.parquet", "flow.parquet"} <= {p.name for p in tmp_path.iterdir()}
    code, err = _run(capsys, *base, "--attribute", "--ablate-heads", "0:1,2:3", "--zero-experts", "2:5")
    assert code == 0, err
    changed = Trace.load(out)
    assert changed.extra["interventions"] == ["zero 2:5", "ablate heads 0:1, 2:3"]
    assert float(changed.site(0, "attn.attribution")[1]) == 0.0 == float(changed.site(2, "attn.attribution")[3])
    bad = [
        (("--attribute", "--target", "100000"), "outside the vocabulary"),
        (("--attribute", "--contrast", "-1"), "outside the vocabulary"),
        (("--attribute", "--position", "12"), "--position 12"),
        (("--attribute", "--target", "fox"), "no tokenizer"),
        (("--attribute", "--generate", "2", "--position", "14"), "--position 14: the run has positions 0..13"),
        (("--target", "7"), "--target applies to --attribute"),
        (("--ablate-heads", "0:9"), "heads are numbered"),
        (("--zero-experts", "2:x"), "expected LAYER:EXPERT"),
    ]
    for flags, message in bad:
        out.unlink(missing_ok=True)
        code, err = _run(capsys, *base, *flags)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)
        assert not out.exists()


def test_the_decode_path_and_a_generation_are_attributed(tiny_model):
    """After --prefill N the position is read in the decode pass that ran it (or in the prefill); with
    --generate the default position is the run's last: the parts, the heads' sources and the experts
    add up there as in one prefill."""
    last = tiny_model.args.n_layers - 1
    for kwargs, position in (({"prefill": 6}, 9), ({"prefill": 6}, 3), ({"generate": 3}, None)):
        request = AttributionRequest(position=position)
        trace = trace_tokens(tiny_model, IDS, record=f"default,{UPDATES}", attribution=request, **kwargs)
        info = trace.extra["attribution"]
        t = trace.n_tokens - 1 if position is None else position
        assert info["position"] == t and info["target"] == int(trace["next.topk_indices"][t, 0])
        if position is None:
            assert float(trace["attribution.total"][0]) == float(trace["logits.last"][info["target"]])
        parts, rest = _parts(trace), float(trace["attribution.rest"][0])
        assert abs(float(trace["attribution.total"][0]) - float(parts.sum()) - rest) <= 1e-5 * float(parts.abs().sum())
        assert abs(rest) <= 0.01 * float(parts.abs().sum())
        u = _direction(tiny_model, trace, trace.site(last, "resid_post")[t].float()).double()
        for i in range(tiny_model.args.n_layers):
            heads = trace.site(i, "attn.attribution").double()
            update = trace.site(i, "attn_out")[t].double()  # rounded to bfloat16 after the heads' float32 sum
            assert abs(float(heads.sum()) - float(update @ u)) <= 2**-8 * float((update * u).abs().sum()), (kwargs, i)
            sources = trace.site(i, "attn.attribution_src").double()
            assert sources.shape == (tiny_model.args.n_heads, trace.n_tokens) and not sources[:, t + 1 :].any()
            remainder = trace.site(i, "attn.attribution_src_rest").double()
            assert torch.allclose(sources.sum(-1) + remainder, heads, rtol=1e-5, atol=1e-6 * float(heads.abs().max()))
            dropped = [s for s in range(t + 1) if s not in trace.site(i, "attn.indexer.topk_indices")[t].tolist()]
            assert not sources[:, dropped].any()
            if i >= tiny_model.args.n_dense_layers:
                routed = trace.site(i, "ffn.routed_out")[t].double() + trace.site(i, "ffn.shared_out")[t].double()
                ffn = trace.site(i, "ffn.attribution").double()
                assert abs(float(ffn.sum()) - float(routed @ u)) <= 1e-4 * abs(float(routed @ u)) + 1e-7
    with pytest.raises(InputError, match="--position 13: the run has positions 0..12"):
        trace_tokens(tiny_model, IDS, attribution=AttributionRequest(position=13), generate=1)


def _names(ids: list[int]) -> list[str]:
    return [f"t{i}" for i in ids]


def test_the_expert_lens_names_what_each_expert_promotes_and_suppresses(tiny_model):
    """Each chosen expert's weighted output through the final norm (its scale frozen at the position's
    final stream) and the head: the five largest and five smallest logit changes, from the run and,
    at any position, from the trace (tracing.analyses.attribution.expert_lens)."""
    args = tiny_model.args
    trace = trace_tokens(
        tiny_model,
        IDS,
        record="default,layers.*.ffn.expert_out",
        attribution=AttributionRequest(position=7),
        token_strings=_names,
    )
    weight = tiny_model.head.weight.float()

    def changes(block, t, slot):
        stream = trace.site(args.n_layers - 1, "resid_post")[t]
        scale = tiny_model.norm.weight.float() * torch.rsqrt(stream.pow(2).mean() + tiny_model.norm.eps)
        return weight @ (trace.site(block, "ffn.expert_out")[t, slot] * scale)  # (V,)

    for i in range(args.n_dense_layers, args.n_layers):
        ids, logits = trace.site(i, "ffn.expert_lens.ids"), trace.site(i, "ffn.expert_lens.logits")
        assert ids.shape == (args.n_routed_experts, 2, 5)
        chosen = sorted(trace.site(i, "ffn.gate.topk_indices")[7].tolist())
        assert torch.nonzero(ids[:, 0, 0] >= 0).flatten().tolist() == chosen
        assert (ids[[e for e in range(args.n_routed_experts) if e not in chosen]] == -1).all()
        for slot, expert in enumerate(chosen):
            change = changes(i, 7, slot)
            torch.testing.assert_close(logits[expert, 0], change.topk(5).values)
            torch.testing.assert_close(logits[expert, 1], change.topk(5, largest=False).values)
            torch.testing.assert_close(change[ids[expert]], logits[expert])
            again = expert_lens(tiny_model, trace, i, 7, expert)
            assert torch.equal(again[0], ids[expert]) and torch.allclose(again[1], logits[expert])
    expert = int(trace.site(2, "ffn.gate.topk_indices")[3, 1])  # another position, from the trace alone
    ids, logits = expert_lens(tiny_model, trace, 2, 3, expert)
    slot = sorted(trace.site(2, "ffn.gate.topk_indices")[3].tolist()).index(expert)
    torch.testing.assert_close(logits[0], changes(2, 3, slot).topk(5).values)
    table = expert_lens_table(trace)
    assert len(table) == (args.n_layers - args.n_dense_layers) * args.n_activated_experts * 10
    assert list(table["token"]) == [trace.extra["vocab"][str(i)] for i in table["token_id"]]
    unchosen = next(e for e in range(args.n_routed_experts) if e not in trace.site(2, "ffn.gate.topk_indices")[3].tolist())
    for call, message in (
        (lambda: expert_lens(tiny_model, trace, 2, 3, unchosen), f"expert {unchosen} was not chosen at position 3"),
        (lambda: expert_lens(tiny_model, trace, 2, 99, expert), "position 99"),
        (lambda: expert_lens(tiny_model, trace_tokens(tiny_model, IDS), 2, 3, expert), "needs layers.2.ffn.expert_out"),
    ):
        with pytest.raises(InputError, match=message):
            call()


def test_streamed_weights_give_the_same_attribution_and_graph(tmp_path, capsys, tiny_checkpoint):
    """--stream loads each block while it runs and frees it after: what the analyses read then (wo and
    wkv_b while their block runs, the head at the end) gives the values of the loaded model."""
    got = {}
    for how in ("--stream", "--device=cpu"):
        out = tmp_path / f"{how.strip('-')}.safetensors"
        argv = ("run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ",".join(map(str, IDS)), "--out", str(out))
        code, err = _run(capsys, *argv, how, "--attribute", "--prefill", "8", "--record", "default,flow")
        assert code == 0, err
        got[how] = Trace.load(out)
    streamed, loaded = got.values()
    names = [n for n in loaded.tensors if "attribution" in n or "flow" in n or "lens" in n]
    assert len(names) > 20 and streamed.extra["attribution"] == loaded.extra["attribution"]
    for name in names:
        assert torch.equal(streamed[name], loaded[name]), name


def test_a_model_of_dense_blocks_only(tiny_source):
    dense = TINY.replace(n_dense_layers=TINY.n_layers)
    model = load_model(SyntheticSource(dense, seed=1))
    trace = trace_tokens(model, IDS, record="default,flow", attribution=AttributionRequest())
    assert all(trace.site(i, "ffn.attribution").shape == (1,) for i in range(dense.n_layers))
    assert not [name for name in trace.tensors if "expert_lens" in name]
    assert trace.site(1, "ffn.flow").shape == (len(IDS), 1)
    kinds = ["dropped keys", "embed", "head", "mlp", "rest", "source", "source_rest"]
    assert sorted(attribution_table(trace)["kind"].unique()) == kinds


def test_the_command_line_encodes_a_text_target(tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    base = ("run", "--checkpoint", str(DEMO), "--prompt", "The capital of France is", "--out", str(out), "--attribute")
    tok = Tokenizer(DEMO)
    (the,) = tok.encode(" the", add_bos=False)
    code, err = _run(capsys, *base, "--target", " the", "--contrast", str(the + 1))
    assert code == 0, err
    assert Trace.load(out).extra["attribution"] == {"position": 8, "target": the, "contrast": the + 1}
    for flags, message in ((("--target", " Paris"), "3 tokens"), (("--target", ""), "not a token")):
        out.unlink(missing_ok=True)
        code, err = _run(capsys, *base, *flags)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, (flags, err)
        assert not out.exists()


def test_an_ablated_head_and_a_zeroed_expert_attribute_nothing(tiny_model):
    base = trace_tokens(tiny_model, IDS, attribution=AttributionRequest())
    chosen = base.site(2, "ffn.gate.topk_indices")[-1]
    expert = int(chosen[0])
    changes = from_spec({"ablate_heads": "1:2,0:0", "zero_experts": {2: [expert]}})
    assert changes == [ZeroExperts({2: (expert,)}), AblateHeads({0: (0,), 1: (2,)})]
    target = AttributionRequest(target=base.extra["attribution"]["target"])
    run = trace_tokens(tiny_model, IDS, interventions=changes, attribution=target)
    assert run.extra["interventions"] == [f"zero 2:{expert}", "ablate heads 0:0, 1:2"]
    assert float(run.site(1, "attn.attribution")[2]) == 0.0 and float(run.site(0, "attn.attribution")[0]) == 0.0
    zeroed = trace_tokens(tiny_model, IDS, interventions=changes[:1], attribution=target)
    assert torch.equal(zeroed.site(2, "ffn.gate.topk_indices"), base.site(2, "ffn.gate.topk_indices"))  # still chosen
    assert float(zeroed.site(2, "ffn.attribution")[expert]) == 0.0 != float(base.site(2, "ffn.attribution")[expert])
    assert float(run.site(1, "attn.attribution")[1]) != 0.0
    for bad, message in (("9:0", "blocks are numbered"), ("0:4", "heads are numbered"), ("0-1", "expected LAYER:HEAD")):
        with pytest.raises(InputError, match=message):
            trace_tokens(tiny_model, IDS, interventions=from_spec({"ablate_heads": bad}))
    with pytest.raises(InputError, match="experts are numbered"):
        trace_tokens(tiny_model, IDS, interventions=from_spec({"zero_experts": "1:99"}))


@needs_demo
def test_removing_the_largest_part_moves_the_logit_its_way(demo_model):
    """Zeroing the head or routed expert with the largest |part| at the attributed position (the last)
    lowers the target logit when the part is positive and raises it when negative, on at least 8 of
    10 prompts."""
    tok = Tokenizer(DEMO)
    agree = []
    for prompt in CAUSAL_PROMPTS:
        ids = tok.encode(prompt)
        base = trace_tokens(demo_model, ids, attribution=AttributionRequest())
        part, key, block, index = max(removable(base), key=lambda c: abs(c[0]))
        there = from_spec({key: f"{block}:{index}@{base.extra['attribution']['position']}"})
        run = trace_tokens(demo_model, ids, interventions=there)
        target = base.extra["attribution"]["target"]
        agree.append(float(run["logits.last"][target] - base["logits.last"][target]) * part < 0)
    assert sum(agree) >= 8, agree


def test_the_dropped_keys_add_exactly_nothing_where_the_indexer_keeps_every_key(tiny_model):
    """T <= index_topk, dense attention, and a decode step that sees at most index_topk keys: the
    dense counterfactual is the same computation on the same bits, so exactly 0; past index_topk it
    is not, and an ablated head, which reads nothing, has nothing dropped either."""
    k = tiny_model.args.index_topk
    short = trace_tokens(tiny_model, IDS[:k], attribution=AttributionRequest())
    dense = trace_tokens(tiny_model, IDS, attribution=AttributionRequest(), interventions=[IndexTopK.dense()])
    early = trace_tokens(tiny_model, IDS, attribution=AttributionRequest(position=k - 1), prefill=k - 2)  # a decode step
    for trace in (short, dense, early):
        for i in range(tiny_model.args.n_layers):
            assert torch.equal(trace.site(i, "attn.attribution_dropped"), torch.zeros(tiny_model.args.n_heads))
    sparse = trace_tokens(tiny_model, IDS, attribution=AttributionRequest(), interventions=from_spec({"ablate_heads": "1:2"}))
    assert all(sparse.site(i, "attn.attribution_dropped").any() for i in range(tiny_model.args.n_layers))
    assert float(sparse.site(1, "attn.attribution_dropped")[2]) == 0.0
    for kwargs in ({}, {"prefill": 6}):  # the prefill's MHA, and the decode path over the caches
        assert trace_tokens(tiny_model, IDS, attribution=AttributionRequest(), **kwargs).site(0, "attn.attribution_dropped").any()
    table = attribution_table(sparse)
    rows = table[table["kind"] == "dropped keys"]
    assert len(rows) == tiny_model.args.n_layers * tiny_model.args.n_heads and set(rows["block"]) == {0, 1, 2}
    assert torch.equal(
        torch.tensor(rows["value"].to_numpy()), torch.cat([sparse.site(i, "attn.attribution_dropped") for i in range(3)])
    )
    assert not set(table["kind"]) - {*ATTRIBUTION_PARTS, "rest", "source", "source_rest", "dropped keys"}


def test_the_dropped_keys_are_what_dense_attention_adds_in_the_first_block(tiny_model):
    """Block 0 reads the embeddings whatever the attention does later, so running it densely gives
    the counterfactual's inputs: its attention update less the sparse run's, along the sparse run's
    direction, is the sum of block 0's dropped parts (up to the bfloat16 rounding of the updates)."""
    request = AttributionRequest()
    trace, seen, t = _attributed(tiny_model, IDS, request)
    target = AttributionRequest(target=trace.extra["attribution"]["target"])
    dense = trace_tokens(
        tiny_model, IDS, record="default,layers.0.attn_out", attribution=target, interventions=[IndexTopK.dense()]
    )
    u = _direction(tiny_model, trace, seen["stream"]).double()
    moved = dense.site(0, "attn_out")[t].double() - trace.site(0, "attn_out")[t].double()
    want, got = float(moved @ u), float(trace.site(0, "attn.attribution_dropped").double().sum())
    scale = float(
        (dense.site(0, "attn_out")[t].double() * u).abs().sum() + (trace.site(0, "attn_out")[t].double() * u).abs().sum()
    )
    assert abs(want - got) <= 2**-7 * scale and abs(got) > 2**-5 * scale, (want, got, scale)
