"""What only this model shows: the indexer's KL from dense attention, the overlap of consecutive
blocks' selections, and the router's margins (docs/cli.md's trace sites give the formulas)."""

from __future__ import annotations

import math

import torch

from model import TINY
from tracing.analyses.recall import indexer_kl, key_overlap
from tracing.runner import trace_tokens

IDS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]  # T=14 > index_topk=8


def test_the_kl_is_zero_when_the_indexer_matches_the_attention_and_positive_otherwise():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(1, 5, 3, 5, generator=g)  # (B, T, H, S): a prefill of 5
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    dense = scores.masked_fill(~causal[None, :, None, :], float("-inf")).softmax(-1).mean(2)  # (B, T, S)
    matching = dense.log().masked_fill(~causal[None], float("-inf"))  # softmax of these is the dense distribution
    assert indexer_kl(scores, matching).abs().max() < 1e-5
    other = torch.randn(1, 5, 5, generator=g).masked_fill(~causal[None], float("-inf"))
    kl = indexer_kl(scores, other)
    assert (kl[0, 1:] > 0).all() and kl[0, 0].abs() < 1e-6  # the first query sees one key: nothing to diverge on


def test_overlap_is_one_for_the_same_keys_and_the_jaccard_share_otherwise():
    a = torch.tensor([[[0, 1, 2, -1], [3, 1, -1, -1]]])
    b = torch.tensor([[[2, 1, 0, -1], [3, 4, 5, -1]]])
    torch.testing.assert_close(key_overlap(a, b, 6), torch.tensor([[1.0, 1 / 4]]))


def test_recorded_overlap_is_one_where_two_blocks_select_the_same_keys(tiny_model):
    base = trace_tokens(tiny_model, IDS)
    keys = base["layers.0.attn.indexer.topk_indices"]
    same = trace_tokens(tiny_model, IDS, patches={"layers.1.attn.indexer.topk_indices": keys})
    assert torch.equal(same["layers.1.attn.indexer.overlap_prev"], torch.ones(len(IDS)))
    assert "layers.0.attn.indexer.overlap_prev" not in base  # no block before the first
    assert (base["layers.1.attn.indexer.overlap_prev"][: TINY.index_topk] == 1).all()  # every visible key, both blocks
    assert base.site(1, "attn.indexer.kl").shape == (len(IDS),) and (base.site(1, "attn.indexer.kl") >= 0).all()


def test_the_margin_is_positive_and_matches_the_biased_scores(tiny_model):
    trace = trace_tokens(tiny_model, IDS)
    per_group = TINY.n_routed_experts // TINY.n_expert_groups
    for block in range(TINY.n_dense_layers, TINY.n_layers):
        biased = trace.site(block, "ffn.gate.biased_scores")
        chosen, groups = trace.site(block, "ffn.gate.topk_indices"), trace.site(block, "ffn.gate.groups")
        margin = trace.site(block, "ffn.gate.margin")
        assert (margin > 0).all()  # the chosen set beats every expert left out
        for t in range(len(IDS)):
            allowed = [e for e in range(TINY.n_routed_experts) if e // per_group in groups[t].tolist()]
            left = [e for e in allowed if e not in chosen[t].tolist()] or [
                e for e in range(TINY.n_routed_experts) if e not in chosen[t].tolist()
            ]
            want = min(biased[t, e] for e in chosen[t].tolist()) - max(biased[t, e] for e in left)
            assert math.isclose(float(margin[t]), float(want), abs_tol=1e-6)
    table = trace.tables()["margins"]
    assert len(table) == len(IDS) * (TINY.n_layers - TINY.n_dense_layers) and "near_tie" in table
    recall = trace.tables()["indexer_recall"]
    assert {"kl", "overlap_prev"} <= set(recall) and recall.loc[recall["block"] == 0, "overlap_prev"].isna().all()


def test_the_group_margin_is_positive_and_matches_the_group_scores(tiny_model):
    """The weakest chosen group's score less the best unchosen one's, recomputed from the recorded
    biased scores by the reference's rule (the top-2 sum per group, with the bias); a near-tie of
    groups is flagged in the margins table."""
    trace = trace_tokens(tiny_model, IDS)
    per_group = TINY.n_routed_experts // TINY.n_expert_groups
    for block in range(TINY.n_dense_layers, TINY.n_layers):
        biased = trace.site(block, "ffn.gate.biased_scores").double()
        group_scores = biased.view(len(IDS), TINY.n_expert_groups, per_group).topk(2, dim=-1).values.sum(-1)  # (T, G)
        torch.testing.assert_close(group_scores.float(), trace.site(block, "ffn.gate.group_scores"), rtol=0, atol=1e-6)
        groups, margin = trace.site(block, "ffn.gate.groups"), trace.site(block, "ffn.gate.group_margin")
        assert margin.shape == (len(IDS),) and (margin > 0).all()  # every chosen set of groups beats the ones left out
        for t in range(len(IDS)):
            chosen = groups[t].tolist()
            left = [g for g in range(TINY.n_expert_groups) if g not in chosen]
            want = min(group_scores[t, g] for g in chosen) - max(group_scores[t, g] for g in left)
            assert math.isclose(float(margin[t]), float(want), abs_tol=1e-6)
    table = trace.tables()["margins"]
    assert {"group_margin", "near_tie_group"} <= set(table) and not table["group_margin"].isna().any()
    assert (table["near_tie_group"] == (table["group_margin"] < 1e-3)).all()
    near = trace_tokens(
        tiny_model, IDS, patches={"layers.1.ffn.gate.group_scores": _tied(trace.site(1, "ffn.gate.group_scores"))}
    )
    assert near.tables()["margins"].query("block == 1")["near_tie_group"].all()


def _tied(scores: torch.Tensor) -> torch.Tensor:
    """Group scores (T, G) whose best unchosen group sits 1e-4 under the weakest chosen one."""
    out = scores.clone()
    ranked = out.sort(dim=-1, descending=True)
    weakest = ranked.values[:, TINY.n_limited_groups - 1]
    out.scatter_(-1, ranked.indices[:, TINY.n_limited_groups : TINY.n_limited_groups + 1], (weakest - 1e-4)[:, None])
    return out


def test_recall_and_kl_share_one_dense_softmax_without_touching_the_scores():
    from tracing.analyses.recall import head_recall, one_dense

    g = torch.Generator().manual_seed(1)
    scores = torch.randn(1, 6, 2, 6, generator=g)  # float32: the copy the softmax masks must not be these
    before = scores.clone()
    index_scores = torch.randn(1, 6, 6, generator=g).masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
    keys = torch.tensor([[[0, -1], [1, 0], [2, 0], [3, 1], [2, 4], [5, 0]]])
    alone = head_recall(scores, keys), indexer_kl(scores, index_scores)
    with one_dense():
        shared = head_recall(scores, keys), indexer_kl(scores, index_scores)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True))
    assert torch.equal(scores, before)
    assert torch.allclose(alone[0][0, 0], torch.ones(2))  # the first query sees one key, selected


def test_next_sites_asked_alone_equal_the_defaults(tiny_model):
    base = trace_tokens(tiny_model, IDS)
    for site in ("next.token_prob", "next.entropy", "next.topk_probs"):
        alone = trace_tokens(tiny_model, IDS, record=[site])
        assert torch.equal(alone[site], base[site]), site
