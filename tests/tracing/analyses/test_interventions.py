"""Interventions: patches, forced selections, ablations, dense attention, and the diff of two traces."""

import json

import pytest
import torch
from safetensors.torch import save_file

from model import TINY
from model.checkpoint import load_model
from tracing.analyses.diff import diff_tables, summary
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import AblateExperts, IndexTopK, NoGateBias
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.runner import trace_tokens
from tracing.sites import LOGIT_LENS

IDS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]  # T=14 > index_topk=8


@pytest.fixture(scope="module")
def base(tiny_model):
    return trace_tokens(tiny_model, IDS, record=["default", LOGIT_LENS])


def test_forcing_the_chosen_selections_changes_nothing(tiny_model, base):
    forced = {f"layers.{i}.attn.indexer.topk_indices": base[f"layers.{i}.attn.indexer.topk_indices"] for i in range(3)}
    forced |= {f"layers.{i}.ffn.gate.topk_indices": base[f"layers.{i}.ffn.gate.topk_indices"] for i in (1, 2)}
    again = trace_tokens(tiny_model, IDS, patches=forced, record=["default", LOGIT_LENS])
    assert all(torch.equal(again[n], v) for n, v in base.tensors.items())


def test_forcing_other_experts_changes_that_blocks_ffn_first(tiny_model, base):
    chosen = base["layers.1.ffn.gate.topk_indices"]
    other = (chosen + 1) % TINY.n_routed_experts  # every token gets other experts
    run = trace_tokens(tiny_model, IDS, patches={"layers.1.ffn.gate.topk_indices": other})
    assert torch.equal(run["layers.1.ffn.gate.topk_indices"], other)
    # weights come from the unbiased scores of the forced experts
    s = run["layers.1.ffn.gate.scores"].gather(1, other)
    torch.testing.assert_close(run["layers.1.ffn.gate.topk_weights"], s / s.sum(-1, keepdim=True) * TINY.route_scale)
    for name in ("layers.0.resid_post", "layers.1.resid_pre", "layers.1.resid_mid", "layers.1.ffn.gate.scores"):
        assert torch.equal(run[name], base[name]), name
    assert not torch.allclose(run["layers.1.resid_post"], base["layers.1.resid_post"])


def test_forced_weights_are_used_as_given(tiny_model, base):
    weights = torch.full_like(base["layers.2.ffn.gate.topk_weights"], 0.25)
    run = trace_tokens(tiny_model, IDS, patches={"layers.2.ffn.gate.topk_weights": weights})
    assert torch.equal(run["layers.2.ffn.gate.topk_weights"], weights)
    assert torch.equal(run["layers.2.resid_mid"], base["layers.2.resid_mid"])
    assert not torch.equal(run["layers.2.resid_post"], base["layers.2.resid_post"])


def test_forced_keys_with_none_and_future_positions(tiny_model, base):
    keys = torch.full((len(IDS), TINY.index_topk), -1, dtype=torch.int64)
    keys[:, 0] = torch.arange(len(IDS))  # each query: only itself
    keys[:, 1] = len(IDS) - 1  # the last position: in the future for all but the last query
    run = trace_tokens(tiny_model, IDS, patches={"layers.0.attn.indexer.topk_indices": keys}, record="all")
    probs = run["layers.0.attn.probs"]  # (T, H, S)
    assert torch.allclose(probs.diagonal(dim1=0, dim2=2), torch.ones(TINY.n_heads, len(IDS)))  # all mass on itself


def test_an_ablated_expert_is_never_selected(tiny_model, base):
    counts = torch.bincount(base["layers.1.ffn.gate.topk_indices"].flatten(), minlength=TINY.n_routed_experts)
    busiest = int(counts.argmax())
    run = trace_tokens(tiny_model, IDS, interventions=[AblateExperts({1: (busiest,)})])
    assert busiest not in run["layers.1.ffn.gate.topk_indices"].flatten().tolist()
    assert torch.equal(run["layers.1.resid_mid"], base["layers.1.resid_mid"])
    assert run.extra["interventions"] == [f"ablate 1:{busiest}"]


def test_routing_without_the_bias_uses_unbiased_scores(tiny_model, base):
    run = trace_tokens(tiny_model, IDS, interventions=[NoGateBias()])
    s = run["layers.2.ffn.gate.scores"]
    assert torch.equal(run["layers.2.ffn.gate.biased_scores"], s)
    groups = s.view(len(IDS), TINY.n_expert_groups, -1).amax(-1).sort(dim=-1, descending=True, stable=True).indices[:, :2]
    assert torch.equal(run["layers.2.ffn.gate.groups"], groups)


def test_dense_attention_equals_a_model_with_topk_at_least_T(tiny_source, tiny_model):
    dense = trace_tokens(tiny_model, IDS, interventions=[IndexTopK.dense()])
    wide = load_model(type(tiny_source)(TINY.replace(index_topk=64), seed=tiny_source.seed))
    reference = trace_tokens(wide, IDS)
    assert dense["layers.0.attn.indexer.topk_indices"].shape == (len(IDS), len(IDS))
    torch.testing.assert_close(dense["logits.last"], reference["logits.last"], rtol=0, atol=0)
    assert (dense["layers.2.attn.indexer.recall"] > 0.9999).all()


def test_diff_of_a_trace_with_itself_is_all_zero(base):
    tables = diff_tables(base, base)
    assert (tables["stream"].rel_l2 == 0).all() and (tables["stream"].cosine > 0.999999).all()
    assert not tables["experts"].changed.any() and not tables["indexer_keys"].changed.any()
    assert not tables["predictions"].changed.any()
    s = summary(base, base, tables)
    assert s["first_block_changed"] is None and s["next_token_kl"] == 0 and s["experts_changed"] == 0


def test_diff_locates_an_ablation(tiny_model, base):
    busiest = int(torch.bincount(base["layers.2.ffn.gate.topk_indices"].flatten()).argmax())
    run = trace_tokens(tiny_model, IDS, interventions=[AblateExperts({2: (busiest,)})])
    s = summary(base, run)
    assert s["first_block_changed"] == 2 and s["experts_changed"] > 0 and s["indexer_keys_changed"] == 0


def test_bad_interventions_are_input_errors(tiny_model):
    with pytest.raises(InputError, match="LAYER:EXPERT"):
        from_spec({"ablate": "3-17"})
    with pytest.raises(InputError, match="not a MoE block"):
        trace_tokens(tiny_model, IDS, interventions=[AblateExperts({0: (1,)})])
    with pytest.raises(InputError, match="forced values must be experts in 0..15"):
        trace_tokens(tiny_model, IDS, patches={"layers.1.ffn.gate.topk_indices": torch.full((14, 4), 16)})


def test_cli_patch_interventions_and_diff(capsys, tiny_checkpoint, tmp_path, base):
    ids = ",".join(map(str, IDS))
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--out", str(a)]) == 0
    patch = tmp_path / "p.safetensors"
    save_file({"layers.1.resid_pre": torch.zeros(len(IDS), TINY.dim)}, str(patch))
    assert (
        main(
            [
                "run",
                "--checkpoint",
                str(tiny_checkpoint),
                "--token-ids",
                ids,
                "--out",
                str(b),
                "--patch",
                str(patch),
                "--ablate-experts",
                "2:0,2:1",
                "--no-gate-bias",
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert main(["diff", str(a), str(b), "--csv", str(tmp_path / "d")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["first_block_changed"] == 1 and out["max_rel_l2_per_block"][0] == 0
    assert (tmp_path / "d" / "stream.csv").read_text().startswith("block,site,position,token,rel_l2,cosine")
    assert (
        main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2", "--out", str(tmp_path / "c.safetensors")]) == 0
    )
    capsys.readouterr()
    assert main(["diff", str(a), str(tmp_path / "c.safetensors")]) == 0  # another length: the last positions
    out = json.loads(capsys.readouterr().out)
    assert out["compared"] == f"the last positions only (the prompts have {len(IDS)} and 2 tokens)"


def test_two_prompts_of_one_length_compare_position_by_position(tiny_model, tmp_path):
    other = list(IDS)
    other[5] = 111
    a, b = (
        trace_tokens(tiny_model, IDS, record=["default", LOGIT_LENS]),
        trace_tokens(tiny_model, other, record=["default", LOGIT_LENS]),
    )
    tables = diff_tables(a, b)
    stream = tables["stream"]
    assert (stream.loc[~stream["same_token"], "position"] == 5).all() and (~stream["same_token"]).any()
    before = stream[stream["position"] < 5]
    assert (before["rel_l2"] == 0).all()  # causal: the positions before the first differing token agree
    assert (stream.loc[stream["position"] == 5, "rel_l2"] > 0).all()
    info = summary(a, b, tables)
    assert info["differing_positions"] == [5] and info["compared"] == "every position"
    for name in ("experts", "indexer_keys", "predictions"):
        assert "same_token" in tables[name] and "token_b" in tables[name]


def test_an_ablated_expert_stays_ablated_without_the_correction_bias(tiny_model, base):
    expert = int(base["layers.1.ffn.gate.topk_indices"][0, 0])
    both = trace_tokens(tiny_model, IDS, interventions=from_spec({"ablate": f"1:{expert}", "no_bias": "all"}))
    assert not (both["layers.1.ffn.gate.topk_indices"] == expert).any()


def test_a_spec_gives_the_interventions_the_command_line_and_the_app_ask_for():
    cli = from_spec({"ablate": "3:40,3:17,5:2", "no_bias": "all", "attention": "dense"})
    assert cli == [NoGateBias(), AblateExperts({3: (17, 40), 5: (2,)}), IndexTopK.dense()]
    app = from_spec({"ablate": {3: [17, 40], 5: [2]}, "no_bias": [2], "attention": 4})
    assert app == [NoGateBias((2,)), AblateExperts({3: (17, 40), 5: (2,)}), IndexTopK(4)]
    assert from_spec({"ablate": "", "no_bias": None, "attention": None}) == []
    with pytest.raises(InputError, match="LAYER:EXPERT"):
        from_spec({"ablate": "3-17"})
