"""The model's behaviour: decode = prefill, sparse = dense when nothing is pruned, routing rules."""

import math

import pytest
import torch

from model import TINY, kernels
from model.checkpoint import load_model
from model.synthetic import SyntheticSource


def capture(model, names):
    """Register recording hooks on hook points by module path; returns (store, handles)."""
    store, handles = {}, []
    modules = dict(model.named_modules())
    for name in names:

        def hook(module, inputs, output, name=name):
            store.setdefault(name, []).append(output.detach().clone())

        handles.append(modules[name].register_forward_hook(hook))
    return store, handles


def remove(handles):
    for h in handles:
        h.remove()


@pytest.fixture(scope="module")
def tiny_fp32(tiny_source):
    return load_model(tiny_source, dtype=torch.float32)


def test_logits_shapes_and_all_positions(tiny_model, tokens):
    with torch.inference_mode():
        last = tiny_model(tokens)
        every = tiny_model(tokens, all_logits=True)
    assert last.shape == (1, TINY.vocab_size) and last.dtype == torch.float32
    assert every.shape == (1, tokens.shape[1], TINY.vocab_size)
    torch.testing.assert_close(every[:, -1], last, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(every).all()


def test_prefill_then_decode_equals_one_long_prefill(tiny_fp32, tokens):
    with torch.inference_mode():
        full = tiny_fp32(tokens, all_logits=True)
        cache = tiny_fp32.new_cache()
        steps = [tiny_fp32(tokens[:, :16], cache=cache)]
        for pos in range(16, tokens.shape[1]):
            steps.append(tiny_fp32(tokens[:, pos : pos + 1], start_pos=pos, cache=cache))
    decoded = torch.stack(steps, dim=1)
    torch.testing.assert_close(decoded, full[:, 15:], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_equals_one_prefill(tiny_fp32, tokens):
    with torch.inference_mode():
        full = tiny_fp32(tokens, all_logits=True)
        cache = tiny_fp32.new_cache()
        tiny_fp32(tokens[:, :10], cache=cache)
        rest = tiny_fp32(tokens[:, 10:], start_pos=10, cache=cache, all_logits=True)
    torch.testing.assert_close(rest, full[:, 10:], rtol=1e-4, atol=1e-4)


def _rope_real(x, pos, freqs, interleaved):
    """Rotation by angle pos * freq, written with cos/sin on real pairs (independent of rope.py)."""
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    ang = pos[:, None] * freqs[None, :]  # (T, R/2)
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    ra, rb = a * cos - b * sin, a * sin + b * cos
    if interleaved:
        return torch.stack([ra, rb], dim=-1).flatten(-2)
    return torch.cat([ra, rb], dim=-1)


def test_sparse_attention_with_topk_at_least_T_is_dense_causal_attention(tokens):
    args = TINY.replace(index_topk=64)  # >= T: the indexer keeps every visible key
    model = load_model(SyntheticSource(args, seed=3), dtype=torch.float32)
    attn = model.layers[1].attn
    seen = {}
    attn.register_forward_hook(lambda m, i, o: seen.update(x=i[0], out=o))
    with torch.inference_mode():
        model(tokens)
        x = seen["x"]
        T = x.shape[1]
        from model.rope import precompute_freqs_cis

        freqs = precompute_freqs_cis(args, T).angle()[1]  # angle at position 1 = the frequencies
        pos = torch.arange(T, dtype=torch.float32)
        q = attn.wq_b(attn.q_norm(attn.wq_a(x))).view(1, T, args.n_heads, args.qk_head_dim)
        q_nope, q_pe = q.split([args.qk_nope_head_dim, args.qk_rope_head_dim], -1)
        kv, k_pe = attn.wkv_a(x).split([args.kv_lora_rank, args.qk_rope_head_dim], -1)
        from model.fp8 import fake_quant

        kv = attn.wkv_b(fake_quant(attn.kv_norm(kv), args.scale_fmt)).view(1, T, args.n_heads, -1)
        k_nope, v = kv.split([args.qk_nope_head_dim, args.v_head_dim], -1)
        q = torch.cat([q_nope, _rope_real(q_pe, pos, freqs, True)], -1)
        k_pe = _rope_real(k_pe.unsqueeze(2), pos, freqs, True).expand(-1, -1, args.n_heads, -1)
        k = torch.cat([k_nope, k_pe], -1)
        scores = torch.einsum("bshd,bthd->bsht", q, k) * args.softmax_scale
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal[None, :, None, :], float("-inf"))
        dense = attn.wo(torch.einsum("bsht,bthd->bshd", scores.softmax(-1), v).flatten(2))
    torch.testing.assert_close(seen["out"], dense, rtol=1e-4, atol=1e-4)


def test_indexer_prunes_and_marks_missing_keys(tiny_model, tokens):
    store, handles = capture(tiny_model, ["layers.0.attn.indexer.topk_indices", "layers.0.attn.indexer.scores"])
    with torch.inference_mode():
        tiny_model(tokens)
    remove(handles)
    topk = store["layers.0.attn.indexer.topk_indices"][0][0]  # (T, K)
    scores = store["layers.0.attn.indexer.scores"][0][0]
    T, K = topk.shape
    assert K == TINY.index_topk < T
    for t in range(T):
        chosen = topk[t][topk[t] >= 0]
        assert len(chosen) == min(t + 1, K)  # -1 exactly where fewer than K keys are visible
        assert torch.all(chosen <= t)
        visible = scores[t, : t + 1]
        assert chosen.tolist() == visible.sort(descending=True, stable=True).indices[: len(chosen)].tolist()


def test_routing_respects_groups_and_route_scale(tiny_model, tokens):
    names = ["layers.1.ffn.gate." + n for n in ("scores", "biased_scores", "groups", "topk_indices", "topk_weights")]
    store, handles = capture(tiny_model, names)
    with torch.inference_mode():
        tiny_model(tokens)
    remove(handles)
    s, b, groups, idx, w = (store[n][0] for n in names)
    per_group = TINY.experts_per_group
    for t in range(idx.shape[0]):
        assert set((idx[t] // per_group).tolist()) <= set(groups[t].tolist())
        assert len(set(groups[t].tolist())) == TINY.n_limited_groups
    torch.testing.assert_close(w.sum(-1), torch.full((idx.shape[0],), TINY.route_scale))
    # weights come from the unbiased scores, selection from the biased ones
    torch.testing.assert_close(w, s.gather(1, idx) / s.gather(1, idx).sum(-1, keepdim=True) * TINY.route_scale)
    bias = tiny_model.layers[1].ffn.gate.bias
    torch.testing.assert_close(b, s + bias)


def test_gate_matches_a_plain_loop_of_the_reference_rules(tiny_model):
    gate = tiny_model.layers[2].ffn.gate
    x = torch.randn(40, TINY.dim, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with torch.inference_mode():
        weights, indices = gate(x)
    s = torch.sigmoid(x.float() @ gate.weight.float().t())
    b = s + gate.bias
    for t in range(40):
        groups = sorted(range(TINY.n_expert_groups), key=lambda g: -sum(sorted(b[t, g * 4 : g * 4 + 4].tolist())[-2:]))
        allowed = [e for g in groups[: TINY.n_limited_groups] for e in range(g * 4, g * 4 + 4)]
        chosen = sorted(allowed, key=lambda e: -b[t, e].item())[: TINY.n_activated_experts]
        assert indices[t].tolist() == chosen
        total = sum(s[t, e].item() for e in chosen)
        assert weights[t].tolist() == pytest.approx([s[t, e].item() / total * TINY.route_scale for e in chosen], rel=1e-6)


def test_residual_hooks_equal_the_unfused_sums(tiny_model, tokens):
    names = [
        f"layers.{i}.{n}" for i in range(TINY.n_layers) for n in ("resid_pre", "attn_out", "resid_mid", "ffn_out", "resid_post")
    ]
    store, handles = capture(tiny_model, names)
    with torch.inference_mode():
        logits = tiny_model(tokens)
    remove(handles)
    get = lambda n: store[n][0]  # noqa: E731
    for i in range(TINY.n_layers):
        pre, mid, post = get(f"layers.{i}.resid_pre"), get(f"layers.{i}.resid_mid"), get(f"layers.{i}.resid_post")
        assert pre.dtype == mid.dtype == post.dtype == torch.float32  # the sums, before rounding
        # each add reads the stream as carried: rounded to bfloat16
        assert torch.equal(mid, pre.bfloat16().float() + get(f"layers.{i}.attn_out").float())
        assert torch.equal(post, mid.bfloat16().float() + get(f"layers.{i}.ffn_out").float())
        if i + 1 < TINY.n_layers:
            assert torch.equal(post, get(f"layers.{i + 1}.resid_pre"))
    with torch.inference_mode():
        again = tiny_model(tokens)
    assert torch.equal(logits, again)  # observing resid_post changed nothing


@pytest.mark.parametrize("site", ["resid_pre", "resid_mid", "resid_post"])
def test_replacing_a_value_with_itself_changes_nothing_and_a_patch_propagates(tiny_model, tokens, site):
    with torch.inference_mode():
        base = tiny_model(tokens)
    point = getattr(tiny_model.layers[1], site)
    handle = point.register_forward_hook(lambda m, i, o: o.clone())
    with torch.inference_mode():
        same = tiny_model(tokens)
    handle.remove()
    assert torch.equal(base, same)
    handle = point.register_forward_hook(lambda m, i, o: o * 0)
    with torch.inference_mode():
        changed = tiny_model(tokens)
    handle.remove()
    assert not torch.allclose(base, changed)


def test_yarn_frequencies_and_softmax_scale():
    from model.rope import precompute_freqs_cis

    args = TINY.replace(max_seq_len=16384, original_seq_len=4096, rope_factor=40)
    freqs = precompute_freqs_cis(args, 2).angle()[1]
    base = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    assert freqs[0] == pytest.approx(base[0].item())  # fast dimensions untouched
    assert freqs[-1] == pytest.approx(base[-1].item() / 40, rel=1e-5)  # slow ones divided by the factor
    assert args.softmax_scale == pytest.approx(96**-0.5 * (0.1 * math.log(40) + 1) ** 2)
    plain = args.replace(max_seq_len=4096)  # the reference's condition: no YaRN at or below 4096
    assert precompute_freqs_cis(plain, 2).angle()[1][-1] == pytest.approx(base[-1].item())
    assert plain.softmax_scale == pytest.approx(96**-0.5)


def test_a_decode_step_needs_the_cache_of_its_prefill(tiny_fp32, tokens):
    """The model keeps no state of a run: a decode step without the Cache of the earlier positions is
    an error, not a hidden continuation; with it, the step is the long prefill's position. No
    module gains an attribute from running (no weight copies, rotations or caches held)."""
    held = {name: dict(vars(m)) for name, m in tiny_fp32.named_modules()}
    with torch.inference_mode():
        full = tiny_fp32(tokens, all_logits=True)
        cache = tiny_fp32.new_cache()
        tiny_fp32(tokens[:, :20], cache=cache)
        with pytest.raises(ValueError, match="continues the Cache"):
            tiny_fp32(tokens[:, 20:21], start_pos=20)
        step = tiny_fp32(tokens[:, 20:21], start_pos=20, cache=cache)
        with pytest.raises(ValueError, match="holds 21 positions"):
            tiny_fp32(tokens[:, 22:23], start_pos=22, cache=cache)
    torch.testing.assert_close(step, full[:, 20], rtol=1e-4, atol=1e-4)
    for name, m in tiny_fp32.named_modules():
        assert vars(m).keys() == held[name].keys(), name
        assert all(vars(m)[k] is v for k, v in held[name].items() if k not in ("_parameters", "_buffers", "_modules")), name


def test_rotations_of_some_positions_are_those_of_all(tiny_fp32):
    """A forward makes the rotations of its own positions only: each is the one the reference's
    table of every position holds."""
    from model.rope import precompute_freqs_cis

    for args in (TINY, TINY.replace(max_seq_len=16384, original_seq_len=4096, rope_factor=40)):
        table = torch.view_as_real(precompute_freqs_cis(args, 700))
        for start, end in ((0, 1), (3, 90), (511, 700)):
            assert torch.equal(torch.view_as_real(precompute_freqs_cis(args, end, start=start)), table[start:end])


@pytest.mark.parametrize("native", [True, False], ids=["native bf16", "float32 route"])
@pytest.mark.parametrize("weights", ["fp8", "fp8 amax/448 scales"])
def test_no_weight_copies_changes_nothing(weights, tokens, native):
    """The path GPUs and the streamer take (no weight copies kept: FP8 weights dequantised at each
    product, the MQA decode's absorbed weight made on the fly) gives the same prefill and decode,
    bit for bit."""
    args = {"fp8": TINY, "fp8 amax/448 scales": TINY.replace(scale_fmt=None)}[weights]
    model = load_model(SyntheticSource(args, seed=2))

    def run() -> list[torch.Tensor]:
        with torch.inference_mode(), kernels.cpu_route(native):
            cache = model.new_cache()
            out = [model(tokens[:, :20], cache=cache, all_logits=True)]
            out += [model(tokens[:, pos : pos + 1], start_pos=pos, cache=cache) for pos in (20, 21)]
        return out

    copied = run()
    for param in model.parameters():
        kernels.use_once(param)  # as the streamer marks what it loads
    for a, b in zip(copied, run(), strict=True):
        assert torch.equal(a, b)
