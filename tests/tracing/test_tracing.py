"""Tracing: the contract tensors, the file format, tables, threads, and the CLI's error paths."""

import io
import threading

import pandas as pd
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from model import TINY
from model.kernels import topk
from tracing.runner import trace_tokens
from tracing.sites import LOGIT_LENS, estimate_bytes, index_range, select, site_shape, site_shapes
from tracing.tables import csv_safe, export, tables, to_csv_bytes
from tracing.trace import BLOCK_GROUPS, SITE_GROUPS, Trace, TraceError
from tracing.tracer import Tracer

IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400, 11, 76, 5, 17]  # T=18 > index_topk=8


RECORD = ["default", LOGIT_LENS]


@pytest.fixture(scope="module")
def trace(tiny_model):
    return trace_tokens(tiny_model, IDS, prompt="p", record=RECORD)


def test_contract_tensors_present_with_their_shapes(trace):
    T, D = len(IDS), TINY.dim
    assert trace["tokens"].tolist() == IDS
    for i in range(TINY.n_layers):
        for site in ("resid_pre", "resid_mid", "resid_post"):
            assert trace[f"layers.{i}.{site}"].shape == (T, D)
        scores = trace[f"layers.{i}.attn.indexer.scores"]
        assert scores.shape == (T, T) and scores.dtype == torch.float32
        assert torch.isinf(scores.triu(1)[scores.triu(1) != 0]).all()  # -inf where masked
        topk = trace[f"layers.{i}.attn.indexer.topk_indices"]
        assert topk.shape == (T, TINY.index_topk) and topk.dtype == torch.int64
        assert (topk[0] == -1).sum() == TINY.index_topk - 1  # the first query sees one key
    for i in range(TINY.n_dense_layers, TINY.n_layers):
        assert trace[f"layers.{i}.ffn.gate.scores"].shape == (T, TINY.n_routed_experts)
        assert trace[f"layers.{i}.ffn.gate.topk_indices"].shape == (T, TINY.n_activated_experts)
        assert trace[f"layers.{i}.ffn.gate.topk_weights"].dtype == torch.float32
    assert "layers.0.ffn.gate.scores" not in trace  # the dense block has no router
    assert trace["logits.last"].shape == (TINY.vocab_size,)


def test_trace_logits_are_the_models(tiny_model, trace):
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([IDS]))[0]
    assert torch.equal(trace["logits.last"], logits)


def test_same_prompt_gives_a_bit_identical_trace_file(tiny_model, trace):
    again = trace_tokens(tiny_model, IDS, prompt="p", record=RECORD)
    assert again.to_bytes() == trace.to_bytes()


def test_expert_selection_recomputed_from_recorded_scores(trace):
    per_group = TINY.experts_per_group
    for i in range(TINY.n_dense_layers, TINY.n_layers):
        biased = trace[f"layers.{i}.ffn.gate.biased_scores"]
        groups = trace[f"layers.{i}.ffn.gate.groups"]
        group_scores = biased.view(-1, TINY.n_expert_groups, per_group).sort(dim=-1, descending=True).values[..., :2].sum(-1)
        assert torch.equal(group_scores, trace[f"layers.{i}.ffn.gate.group_scores"])
        assert torch.equal(group_scores.topk(TINY.n_limited_groups, dim=-1).indices, groups)
        allowed = torch.zeros_like(biased, dtype=torch.bool)
        for t in range(len(IDS)):
            for g in groups[t]:
                allowed[t, g * per_group : (g + 1) * per_group] = True
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(TINY.n_activated_experts, dim=-1).indices
        assert torch.equal(chosen, trace[f"layers.{i}.ffn.gate.topk_indices"])


def test_indexer_selection_recomputed_from_recorded_scores(trace):
    for i in range(TINY.n_layers):
        scores = trace[f"layers.{i}.attn.indexer.scores"]
        topk = trace[f"layers.{i}.attn.indexer.topk_indices"]
        for t in range(len(IDS)):
            k = min(t + 1, TINY.index_topk)
            # best first; equal scores (ReLU zeros) go to the lower key, as CUDA's top-k fills ties
            assert topk[t, :k].tolist() == scores[t, : t + 1].sort(descending=True, stable=True).indices[:k].tolist()


def test_size_estimate_is_exact(trace):
    names = select(TINY, RECORD)
    actual = sum(t.numel() * t.element_size() for t in trace.tensors.values())
    assert estimate_bytes(TINY, names, len(IDS)) == actual


def test_record_patterns_choose_sites(tiny_model):
    small = trace_tokens(tiny_model, IDS[:6], record="layers.*.ffn.gate.*")
    assert {n for n in small.tensors if n != "tokens"} == {
        f"layers.{i}.ffn.gate.{s}"
        for i in (1, 2)
        for s in ("scores", "biased_scores", "group_scores", "groups", "topk_indices", "topk_weights", "margin", "group_margin")
    }
    full = trace_tokens(tiny_model, IDS[:6], record="all")
    assert full["layers.1.attn.probs"].shape == (6, TINY.n_heads, 6)
    torch.testing.assert_close(full["layers.1.attn.probs"].mean(1), full["layers.1.attn.probs_mean"])


def test_two_threads_on_one_model_do_not_mix(tiny_model):
    prompts = [IDS, list(reversed(IDS))[:11]]
    alone = [trace_tokens(tiny_model, p).to_bytes() for p in prompts]
    results: dict[int, bytes] = {}
    barrier = threading.Barrier(2)

    def work(k):
        for _ in range(3):
            barrier.wait()
            results[k] = trace_tokens(tiny_model, prompts[k]).to_bytes()
            assert results[k] == alone[k]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: alone[0], 1: alone[1]}


def test_hooks_are_removed_on_exit_and_after_an_exception(tiny_model):
    def count():
        return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in tiny_model.modules())

    before = count()
    with pytest.raises(RuntimeError, match="boom"):
        with Tracer(tiny_model, "all", on_block=lambda i: None):
            assert count() > before
            raise RuntimeError("boom")
    assert count() == before


def test_patching_a_site_with_its_recorded_value_reproduces_the_trace(tiny_model, trace):
    patches = {
        name: trace[name]
        for name in ("layers.1.resid_mid", "layers.2.ffn.gate.topk_indices", "layers.1.attn.indexer.topk_indices")
    }
    patched = trace_tokens(tiny_model, IDS, prompt="p", patches=patches, record=RECORD)
    for name, value in trace.tensors.items():
        assert torch.equal(patched[name], value), name
    assert patched.extra["patched"] == sorted(patches)


def test_file_round_trip_and_validation(tmp_path, trace):
    path = trace.save(tmp_path / "t.safetensors")
    again = Trace.load(path)
    assert again.tokens == trace.tokens and again.prompt == "p" and again.config == trace.config
    assert all(torch.equal(again[n], trace[n]) for n in trace.tensors)
    bad = Trace(dict(trace.tensors), trace.config, trace.tokens)
    bad.tensors["layers.0.resid_pre"] = torch.zeros(3, 3)
    with pytest.raises(TraceError, match=r"layers\.0\.resid_pre.*shape \[3, 3\], expected \[18, 256\]"):
        Trace.from_bytes(bad.to_bytes())
    bad.tensors = dict(trace.tensors) | {"layers.0.nonsense": torch.zeros(1)}
    with pytest.raises(TraceError, match="not a trace site"):
        Trace.from_bytes(bad.to_bytes())
    (tmp_path / "junk.safetensors").write_bytes(b"not a trace")
    with pytest.raises(TraceError, match="junk.safetensors: not a readable trace file"):
        Trace.load(tmp_path / "junk.safetensors")
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TraceError, match="format is 'pt'"):
        Trace.load(tmp_path / "other.safetensors")


_SITES = sorted(n for n in site_shapes(TINY) if not n.endswith(".probs") and not n.endswith("attn.scores"))


def _with_groups(chosen: list[str]) -> list[str]:
    """The sites and the rest of each one's group (tracing.trace: read together, held together)."""
    out = list(chosen)
    for name in chosen:
        for group in SITE_GROUPS:
            out += group if name in group else ()
        for group in BLOCK_GROUPS:
            block, _, suffix = name.removeprefix("layers.").partition(".")
            out += [f"layers.{block}.{s}" for s in group] if name.startswith("layers.") and suffix in group else []
    return sorted(set(out))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(1, 12),
    words=st.lists(st.text(min_size=0, max_size=6), min_size=12, max_size=12),
    prompt=st.text(max_size=40),
    chosen=st.lists(st.sampled_from(_SITES), max_size=6, unique=True),
    seed=st.integers(0, 2**16),
)
def test_any_trace_survives_the_file_round_trip(n, words, prompt, chosen, seed):
    gen = torch.Generator().manual_seed(seed)
    shapes = site_shapes(TINY)
    tensors = {"tokens": torch.randint(0, TINY.vocab_size, (n,), generator=gen)}
    for name in _with_groups(chosen):
        legend, dtype = shapes[name]
        shape = site_shape(TINY, name, legend, n)
        if dtype == torch.int64:
            tensors[name] = torch.randint(*index_range(TINY, name, n), shape, generator=gen)
        else:
            tensors[name] = torch.randn(shape, generator=gen)
    original = Trace(tensors, TINY, words[:n], prompt, {"note": words[0]})
    again = Trace.from_bytes(original.to_bytes())
    assert again.tokens == original.tokens and again.prompt == prompt and again.extra == original.extra
    assert set(again.tensors) == set(tensors) >= set(chosen)
    assert all(torch.equal(again[k], v) for k, v in tensors.items())


def test_tables_are_tidy_and_consistent(trace):
    t = tables(trace)
    router = t["router"]
    assert len(router) == 2 * len(IDS) * TINY.n_routed_experts
    assert (router.groupby(["block", "position"])["selected"].sum() == TINY.n_activated_experts).all()
    assert router.loc[router.selected, "weight"].groupby([router.block, router.position]).sum().round(5).eq(2.5).all()
    assert set(router.loc[router.selected, "group_chosen"]) == {True}
    load = t["expert_load"]
    assert (load.groupby("block")["count"].sum() == len(IDS) * TINY.n_activated_experts).all()
    idx = t["indexer"]
    assert len(idx) == TINY.n_layers * len(IDS) * (len(IDS) + 1) // 2  # visible pairs only
    assert (idx.groupby(["block", "query"])["selected"].sum().values == [min(q + 1, 8) for q in range(len(IDS))] * 3).all()
    recall = t["indexer_recall"]
    assert recall.recall.between(0, 1 + 1e-6).all() and (recall.loc[recall["query"] < 8, "recall"] > 0.999).all()
    lens = t["logit_lens"]
    assert set(lens["rank"]) == set(range(5)) and lens.probability.between(0, 1).all()
    res = t["residual"]
    assert {"norm_pre", "norm_mid", "norm_post", "attn_update_norm", "ffn_update_norm", "cos_prev"} <= set(res.columns)


def test_csv_neutralises_formulas_and_keeps_numbers(tmp_path, trace):
    risky = Trace(trace.tensors, trace.config, ["=1+1", "+x", "-y", "@z", "\tt", "\rr", "plain", "ok"] + trace.tokens[8:])
    frame = pd.read_csv(io.BytesIO(to_csv_bytes(tables(risky)["tokens"])), keep_default_na=False)
    assert frame.token.tolist()[:8] == ["'=1+1", "'+x", "'-y", "'@z", "'\tt", "'\rr", "plain", "ok"]
    assert frame.position.dtype.kind == "i" and frame.token_id.dtype.kind == "i"
    numbers = csv_safe(pd.DataFrame({"x": [-1.5, 2.0]}))
    assert numbers.x.tolist() == [-1.5, 2.0]
    written = export(risky, tmp_path / "csv", parquet=True)
    assert (tmp_path / "csv" / "router.csv").read_text(encoding="utf-8").startswith("block,position,token,expert,group,score")
    assert (tmp_path / "csv" / "router.parquet") in written


@pytest.mark.parametrize("n", [1, 9, len(IDS) - 1])
def test_prefill_then_decode_fills_the_sites_of_one_prefill(tiny_model, trace, n):
    """--prefill n: positions n.. run one at a time through the decode path; the trace has the
    sites, shapes and dtypes of one prefill, the prefill's rows as a prefill of n gives them, and
    each decode row as the model's own decode step gives it."""
    decoded = trace_tokens(tiny_model, IDS, prompt="p", record=RECORD, prefill=n)
    assert decoded.extra["prefill"] == n
    assert set(decoded.tensors) == set(trace.tensors)
    for name, value in trace.tensors.items():
        assert (decoded[name].shape, decoded[name].dtype) == (value.shape, value.dtype), name
    head = trace_tokens(tiny_model, IDS[:n], record=RECORD)
    for name, value in head.tensors.items():
        if name == "next.token_prob":  # after the last prompt position: the greedy token's, not the next one's
            value = value[:-1]
        if name != "logits.last" and value.dim() and value.shape[0] in (n, n - 1):  # key and top-k columns: the first n
            assert torch.equal(decoded[name][tuple(slice(0, size) for size in value.shape)], value), name
    T, K = len(IDS), TINY.index_topk
    for i in range(TINY.n_layers):
        scores = decoded[f"layers.{i}.attn.indexer.scores"]
        visible = torch.ones(T, T, dtype=torch.bool).tril()
        assert torch.isfinite(scores[visible]).all() and torch.isneginf(scores[~visible]).all()
        selected = decoded[f"layers.{i}.attn.indexer.topk_indices"]
        assert selected.shape == (T, K)
        for t in range(n, T):
            row = selected[t]
            assert row[row >= 0].tolist() == topk(scores[t, : t + 1], min(K, t + 1))[1].tolist()  # ties: lower key first
            assert (row[min(K, t + 1) :] == -1).all()
    with torch.inference_mode():
        cache = tiny_model.new_cache()
        tiny_model(torch.tensor([IDS[:n]]), cache=cache)
        for pos in range(n, T):
            logits = tiny_model(torch.tensor([IDS[pos : pos + 1]]), start_pos=pos, cache=cache)
    assert torch.equal(decoded["logits.last"], logits[0])


def test_decode_path_agrees_with_the_prefill_in_float32(tiny_source):
    """The MHA prefill and the absorbed MQA decode are the same function; in float32 they agree to
    float32 rounding (in bfloat16 each rounds its own intermediate products)."""
    from model.checkpoint import load_model

    model = load_model(tiny_source, dtype=torch.float32)
    full = trace_tokens(model, IDS)
    decoded = trace_tokens(model, IDS, prefill=4)
    for name, value in full.tensors.items():
        if name.endswith("topk_indices"):
            assert torch.equal(decoded[name], value), name
        elif value.is_floating_point():
            finite = torch.isfinite(value)
            assert torch.equal(finite, torch.isfinite(decoded[name])), name
            assert torch.allclose(decoded[name][finite], value[finite], rtol=1e-4, atol=1e-5), name


def test_index_grid_marks_each_rows_choices_and_skips_none():
    import numpy as np

    from tracing.tables.grid import index_grid

    chosen = np.array([[2, 0], [1, -1]])  # -1: no choice
    assert index_grid(chosen, 3).tolist() == [[True, False, True], [False, True, False]]
    assert index_grid(chosen, 3, np.arange(2), -1, np.int64).tolist() == [[1, -1, 0], [-1, 0, -1]]
    assert index_grid(chosen, 3, [[0.5, 0.25], [1.0, 9.0]], 0.0, np.float32).tolist() == [[0.25, 0, 0.5], [0, 1.0, 0]]
