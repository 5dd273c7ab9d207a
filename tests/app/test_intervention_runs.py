"""The Interventions page's runs without Streamlit (app.topics.intervention_runs): picks as plain values
make the command line's spec, an ablated expert is never chosen in the intervened run and the diff
says where the runs part, removals at a position leave the positions before it alone, and a
checkpoint that does not open is refused with a reason."""

from __future__ import annotations

import pytest
import torch

from app.core.errors import BAD_INPUT
from app.core.models import open_model
from app.core.traces import TraceKey
from app.topics import intervention_runs as runs
from app.topics.interventions import ARRIVING, ask_to_remove
from model import TINY
from tracing.analyses.interventions import AblateExperts, AblateHeads, NoGateBias, ZeroExperts
from tracing.cli.loading import REPO
from tracing.errors import InputError

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def om(app_checkpoint):
    return open_model(app_checkpoint, "bfloat16")


@pytest.fixture(scope="module")
def base(om):
    return runs.baseline(om, TraceKey.for_prompt(om, PROMPT))


def test_the_picks_make_the_command_lines_spec():
    state = {"iv_experts_1": [3, 0], "iv_ablate_text": "2:5", "iv_heads_0": [1], "iv_no_bias": True, "iv_at": " 2: "}
    spec = runs.spec_of(state, TINY)
    assert spec["ablate"] == {1: [0, 3], 2: [5]} and spec["ablate_heads"] == {0: [1]} and spec["zero_experts"] == {}
    assert spec["no_bias"] == "all" and spec["attention"] is None and spec["at"] == "2:"
    at = (2, None)  # the removals act from position 2 on; the router's bias is not a removal
    expected = [NoGateBias(), AblateExperts({1: (0, 3), 2: (5,)}, positions=at), AblateHeads({0: (1,)}, positions=at)]
    assert sorted(map(repr, runs.changes(spec))) == sorted(map(repr, expected))
    assert runs.spec_of({"iv_attention": "topk", "iv_topk": 3}, TINY)["attention"] == 3
    assert runs.changes(runs.spec_of({}, TINY)) == []  # nothing picked: nothing to run
    with pytest.raises(InputError, match="--zero-experts"):
        runs.spec_of({"iv_zero_text": "1:x"}, TINY)


def test_a_removal_asked_elsewhere_is_the_only_pick_and_clear_empties_them():
    state = {"iv_experts_1": [2], "iv_no_bias": True, "iv_attention": "dense"}
    ask_to_remove(state, "zero_experts", 2, 7, position=4)
    assert runs.arrive(state) and ARRIVING not in state and not runs.arrive(state)
    runs.keep(state, TINY)
    assert runs.changes(runs.spec_of(state, TINY)) == [ZeroExperts({2: (7,)}, positions=(4, 5))]
    assert state["iv_zero_block"] == 2
    runs.clear(state)
    assert runs.changes(runs.spec_of(state, TINY)) == []


def test_keep_drops_picks_the_model_lacks():
    state = {"iv_experts_0": [1], "iv_experts_2": [3, 99], "iv_no_bias_blocks": [0, 2], "iv_topk": 10**9, "block": 2}
    runs.keep(state, TINY)  # block 0 is dense; experts are 0..15; index_topk at most the context
    assert "iv_experts_0" not in state and state["iv_experts_2"] == [3] and state["iv_no_bias_blocks"] == [2]
    assert state["iv_topk"] == TINY.max_seq_len and state["iv_block"] == 2 and state["iv_head_block"] == 2


def test_an_ablated_expert_is_never_chosen_and_the_diff_finds_its_block(om, base):
    block = om.args.n_dense_layers
    chosen = base.trace[f"layers.{block}.ffn.gate.topk_indices"]
    busiest = int(torch.bincount(chosen.flatten()).argmax())
    spec = runs.spec_of({f"iv_experts_{block}": [busiest]}, om.args)
    iv = runs.intervened(om, base, spec)
    assert iv.key.plain == base.key and iv.key != base.key
    assert busiest not in iv.trace[f"layers.{block}.ffn.gate.topk_indices"].flatten().tolist()
    tables, info = runs.diff(base, iv)
    assert info["first_block_changed"] == block
    experts = tables["experts"]
    assert experts[experts["block"] < block].empty or not experts[experts["block"] < block]["changed"].any()
    assert experts[experts["block"] == block]["changed"].any()
    assert runs.baseline(om, iv.key) is base  # the baseline of an intervened key is the plain trace


def test_removals_at_a_position_leave_the_positions_before_alone(om, base):
    at = 3
    spec = runs.spec_of({"iv_heads_0": [0, 1], "iv_at": str(at)}, om.args)
    iv = runs.intervened(om, base, spec)
    a, b = base.trace["layers.0.resid_post"], iv.trace["layers.0.resid_post"]
    assert torch.equal(a[..., :at, :], b[..., :at, :])
    assert not torch.equal(a[..., at, :], b[..., at, :])


def test_another_checkpoint_that_does_not_open_is_refused(om, tmp_path):
    with pytest.raises(BAD_INPUT):
        runs.open_other(om, str(tmp_path / "nothing here"))


def test_the_same_checkpoint_compared_with_itself_differs_nowhere(om, base, app_checkpoint):
    a, b = runs.traced_pair(om, base, runs.open_other(om, app_checkpoint))
    assert a.key.variant == runs.PAIR and a.trace.token_ids == base.trace.token_ids and "logits.all" in b.trace
    tables, info = runs.pair_diff(a, b)
    assert info["first_block_changed"] is None and info["kl_mean"] == 0.0 and info["top1_agreement"] == 1.0
    assert len(tables["blocks"]) == om.args.n_layers


def test_an_uploaded_graph_needs_its_constants_file_and_one_json():
    examples = REPO / "docs" / "examples"
    graph, constants = ((name, (examples / name).read_bytes()) for name in ("steering.json", "steering.safetensors"))
    assert runs.read_graph([]) is None
    assert runs.read_graph([graph, constants]).tensors["direction"].shape == (256,)
    with pytest.raises(InputError, match="steering.safetensors: upload that file with the graph"):
        runs.read_graph([graph])
    with pytest.raises(InputError, match="got 2 .json files"):
        runs.read_graph([graph, ("other.json", b"{}")])
    with pytest.raises(InputError, match="not JSON"):
        runs.read_graph([("bad.json", b"{nope")])
