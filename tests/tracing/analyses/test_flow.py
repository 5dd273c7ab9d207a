"""The contribution graph (--record flow): shares of each receiving stream that sum to one, keys the
indexer dropped and experts not chosen at exactly 0, the formula of docs/attribution.md computed
the plain way, and interventions moving the shares as they must."""

from __future__ import annotations

import pytest
import torch

from model import fp8
from tracing.analyses.flow import attention_flow, proximity
from tracing.analyses.intervention_specs import from_spec
from tracing.runner import trace_tokens
from tracing.sites import select
from tracing.tables.frames import flow_table

IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400]
BLOCK = 1  # a MoE block of the tiny config


def _flow(model, ids=IDS, **kwargs):
    return trace_tokens(
        model, ids, record="default,flow,layers.*.attn.probs,layers.*.ffn.expert_out,layers.*.ffn.shared_out", **kwargs
    )


def test_flow_is_named_not_all(tiny_model):
    flow = select(tiny_model.args, "flow")
    assert flow and all(".flow" in name for name in flow)
    assert not set(flow) & set(select(tiny_model.args, "all"))


def test_shares_sum_to_one_and_dropped_keys_and_experts_hold_zero(tiny_model):
    trace = _flow(tiny_model)
    n = len(IDS)
    for i in range(tiny_model.args.n_layers):
        keys, kept = trace.site(i, "attn.flow"), trace.site(i, "attn.flow_resid")
        assert keys.shape == (n, n) and (keys >= 0).all()
        torch.testing.assert_close(keys.sum(-1) + kept, torch.ones(n))
        selected = trace.site(i, "attn.indexer.topk_indices")
        for t in range(n):
            dropped = [s for s in range(n) if s not in selected[t].tolist()]  # not selected, or after t
            assert not keys[t, dropped].any(), (i, t)
        experts, stayed = trace.site(i, "ffn.flow"), trace.site(i, "ffn.flow_resid")
        torch.testing.assert_close(experts.sum(-1) + stayed, torch.ones(n))
        if i >= tiny_model.args.n_dense_layers:
            assert experts.shape == (n, tiny_model.args.n_routed_experts + 1)
            chosen = torch.zeros_like(experts[:, :-1], dtype=torch.bool).scatter_(1, trace.site(i, "ffn.gate.topk_indices"), True)
            assert not experts[:, :-1][~chosen].any()
        else:
            assert experts.shape == (n, 1)
    table = flow_table(trace)
    keys = table[(table["stage"] == "attn") & (table["kind"] == "key")]
    assert (keys["source"] <= keys["position"]).all() and (table["share"] > 0).all()
    assert table.groupby(["block", "stage", "position"])["share"].sum().sub(1).abs().max() < 1e-5


def test_the_attention_shares_follow_the_formula(tiny_model):
    """A[t, s] = sum_h W_o,h p[t, h, s] v[s, h]; c = max(0, |y|_1 - |y - A|_1) over the parts, the
    residual included: computed here in one einsum from the recorded probabilities and the values
    the prefill's wkv_b produced."""
    attn = tiny_model.layers[BLOCK].attn
    seen = {}
    handle = attn.wkv_b.register_forward_hook(lambda m, i, o: seen.__setitem__("kv", o[0].float()))
    try:
        trace = _flow(tiny_model)
    finally:
        handle.remove()
    heads, nope = attn.n_heads, attn.qk_nope_head_dim
    values = seen["kv"].view(len(IDS), heads, -1)[..., nope:]  # (S, H, Dv)
    columns = fp8.weight_dequant(attn.wo.weight, attn.wo.scale).view(-1, heads, attn.v_head_dim)  # (D, H, Dv)
    probs = trace.site(BLOCK, "attn.probs")  # (T, H, S)
    brought = torch.einsum("ths,shv,dhv->tsd", probs, values, columns)  # (T, S, D)
    y, x = trace.site(BLOCK, "resid_mid"), trace.site(BLOCK, "resid_pre")
    near = (y.abs().sum(-1)[:, None] - (y[:, None] - brought).abs().sum(-1)).clamp(min=0)
    near = near * (probs.amax(1) > 0)  # keys read by no head are no part
    kept = (y.abs().sum(-1) - (y - x).abs().sum(-1)).clamp(min=0)
    total = near.sum(-1) + kept
    torch.testing.assert_close(trace.site(BLOCK, "attn.flow"), near / total[:, None], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(trace.site(BLOCK, "attn.flow_resid"), kept / total, atol=1e-5, rtol=1e-4)
    again = attention_flow(probs, values, columns, x, y, probs.amax(1) > 0, budget=1, through_budget=1)  # key by key
    torch.testing.assert_close(again[0], trace.site(BLOCK, "attn.flow"), atol=1e-6, rtol=1e-5)
    # the FFN: each expert's weighted output and the shared expert against resid_post
    post = trace.site(BLOCK, "resid_post")
    parts = torch.cat([trace.site(BLOCK, "ffn.expert_out"), trace.site(BLOCK, "ffn.shared_out")[:, None]], dim=1)
    near = proximity(parts.transpose(0, 1), post).T  # (T, k + 1)
    stayed = proximity(y, post)
    slots = trace.site(BLOCK, "ffn.gate.topk_indices").sort(-1).values
    shares = trace.site(BLOCK, "ffn.flow")
    total = near.sum(-1) + stayed
    torch.testing.assert_close(shares.gather(1, slots), near[:, :-1] / total[:, None], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(shares[:, -1], near[:, -1] / total, atol=1e-6, rtol=1e-5)


def test_interventions_move_the_shares(tiny_model):
    base = _flow(tiny_model)
    ablated = _flow(tiny_model, interventions=from_spec({"ablate_heads": {BLOCK: list(range(tiny_model.args.n_heads))}}))
    assert not ablated.site(BLOCK, "attn.flow").any()  # no head reads anything: the stream keeps all
    torch.testing.assert_close(ablated.site(BLOCK, "attn.flow_resid"), torch.ones(len(IDS)))
    expert = int(base.site(2, "ffn.gate.topk_indices")[-1, 0])
    zeroed = _flow(tiny_model, interventions=from_spec({"zero_experts": {2: [expert]}}))
    assert float(base.site(2, "ffn.flow")[-1, expert]) > 0 and float(zeroed.site(2, "ffn.flow")[-1, expert]) == 0
    dense = _flow(tiny_model, interventions=from_spec({"attention": "dense"}))
    t = len(IDS) - 1
    assert int((base.site(BLOCK, "attn.flow")[t] > 0).sum()) <= tiny_model.args.index_topk
    assert int((dense.site(BLOCK, "attn.flow")[t] > 0).sum()) > tiny_model.args.index_topk  # every key read


@pytest.mark.parametrize("kwargs", [{"prefill": 5}, {"generate": 3}])
def test_the_decode_path_gives_the_graph_of_every_position(tiny_model, kwargs):
    trace = _flow(tiny_model, **kwargs)
    n = trace.n_tokens
    whole = _flow(tiny_model, trace.token_ids)  # the same positions in one prefill
    for i in range(tiny_model.args.n_layers):
        keys = trace.site(i, "attn.flow")
        assert keys.shape == (n, n) and not keys.triu(1).any()
        torch.testing.assert_close(keys.sum(-1) + trace.site(i, "attn.flow_resid"), torch.ones(n))
        # the decode path's rounding differs from the prefill's: the same graph to within a few hundredths
        assert (keys - whole.site(i, "attn.flow")).abs().max() < 0.05
