"""DeepSeek-V3's layout (V3, R1, V3.1): no lightning indexer, computed as V3's own reference does.

The reference below is deepseek-ai/DeepSeek-V3 ``inference/model.py`` (its defaults: ``gemm_impl =
"bf16"``, ``attn_impl = "absorb"``, modules built in bfloat16) written out in plain PyTorch over the
loaded model's parameters: a straightforward recomputation that shares no code with the model.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from model import TINY, kernels
from model.checkpoint import SafetensorsSource, expected_specs, load_model
from model.config import ConfigError, ModelArgs
from model.fp8 import expand_scale
from model.rope import precompute_freqs_cis
from model.synthetic import SyntheticSource, v3_layout, write_synthetic_checkpoint

REAL_HF = "assets/configs/config_671B_hf.json"
V3 = v3_layout(TINY)


def _v3_hf_config() -> dict:
    """The 671B config as DeepSeek-V3's config.json has it: model_type deepseek_v3, no index_* keys."""
    data = json.loads(open(REAL_HF).read())
    data = {k: v for k, v in data.items() if not k.startswith("index_")}
    return {**data, "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}


def test_the_layout_is_read_from_the_config():
    v32 = ModelArgs.from_file(REAL_HF)
    v3 = ModelArgs.from_hf(_v3_hf_config())
    assert v32.has_indexer and not v3.has_indexer
    assert v3.replace(extra={}) == v32.replace(indexer=False, extra={})  # the same model but the indexer
    out = v3.to_hf()
    assert out["model_type"] == "deepseek_v3" and not any(k.startswith("index_") for k in out)
    assert ModelArgs.from_hf(out) == v3
    reference = v3.to_reference()  # V3's own ModelArgs has no index_* fields
    assert not any(k.startswith("index_") for k in reference) and not ModelArgs.from_reference(reference).has_indexer
    assert ModelArgs.from_reference(v32.to_reference()).has_indexer
    # a V3.2 config must have its indexer's sizes; a V3 one's index fields are not asked for
    with pytest.raises(ConfigError, match="missing field 'index_n_heads'"):
        ModelArgs.from_hf({**_v3_hf_config(), "model_type": "deepseek_v32"})


def test_the_config_chooses_the_family():
    """A deepseek_v3 config builds model.v3's modules (its MTP block too), V3.2-Exp's the reference's;
    both have the same hook points but the indexer's, and neither Transformer builds the other's config."""
    from model import attention, moe, norm, transformer, v3
    from model.checkpoint import build_model
    from model.hooks import HookPoint

    overridden = {transformer.Transformer, transformer.Block, attention.MLA, norm.RMSNorm, moe.MLP, moe.Expert, moe.Gate, moe.MoE}
    built = {args.model_type: build_model(args.replace(n_mtp_layers=1), mtp=True) for args in (TINY, V3)}
    v3_model, v32_model = built["deepseek_v3"], built["deepseek_v32"]
    assert type(v3_model) is v3.Transformer and type(v32_model) is transformer.Transformer
    assert isinstance(v3_model.mtp[0].block, v3.Block) and isinstance(v3_model.layers[-1].ffn.gate, v3.Gate)
    main = [v3_model, *v3_model.layers.modules(), v3_model.norm, *v3_model.mtp[0].block.modules()]
    assert not {type(m) for m in main} & overridden  # every module that computes differently is V3's
    assert not any(type(m).__module__ == "model.v3" for m in v32_model.modules())

    def points(model):
        return {name for name, m in model.named_modules() if isinstance(m, HookPoint)}

    assert points(v3_model) == {name for name in points(v32_model) if ".indexer." not in name}
    with pytest.raises(TypeError, match="deepseek_v3 config builds model.v3.Transformer"):
        transformer.Transformer(V3)
    with pytest.raises(TypeError, match="deepseek_v32 config builds model.transformer.Transformer"):
        v3.Transformer(TINY)


def test_a_v3_checkpoint_has_no_indexer_and_bf16_norms(tmp_path):
    specs = expected_specs(V3)
    assert not [name for name in specs if "indexer" in name]
    assert specs["model.layers.0.input_layernorm.weight"].dtype == torch.bfloat16  # V3 stores its gains so
    assert expected_specs(TINY)["model.layers.0.input_layernorm.weight"].dtype == torch.float32
    assert len(specs) == len(expected_specs(TINY)) - 7 * TINY.n_layers  # the indexer's 7 tensors per block
    write_synthetic_checkpoint(tmp_path / "v3", V3, seed=3)
    source = SafetensorsSource(tmp_path / "v3")
    assert not source.args.has_indexer
    model = load_model(source)
    assert all(block.attn.indexer is None for block in model.layers)
    assert not [name for name, _ in model.named_parameters() if "indexer" in name]
    tokens = torch.randint(0, V3.vocab_size, (1, 9))
    assert torch.equal(model(tokens), load_model(SyntheticSource(V3, seed=3))(tokens))


# --- V3's reference, written out --------------------------------------------------------------------


def _linear(x: torch.Tensor, linear) -> torch.Tensor:
    """V3's ``linear`` with ``gemm_impl = "bf16"``: an FP8 weight is dequantised to bfloat16 (code times
    scale in float32, rounded), then ``F.linear`` in the activation dtype; the input is not quantised."""
    w = linear.weight
    if linear.scale is not None:
        w = (w.float() * expand_scale(linear.scale.float(), w.shape)).to(torch.bfloat16)
    return F.linear(x, w.to(x.dtype))


def _rms(norm, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (norm.dim,), norm.weight.to(torch.bfloat16), norm.eps)  # V3's bf16 module


def _rotary(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    y = torch.view_as_complex(x.float().view(*x.shape[:-1], -1, 2))
    y = torch.view_as_real(y * freqs.view(1, y.size(1), 1, y.size(-1))).flatten(3)
    return y.to(x.dtype)


def _dequant(linear) -> torch.Tensor:
    return (linear.weight.float() * expand_scale(linear.scale.float(), linear.weight.shape)).to(torch.bfloat16)


def _mla(attn, x, start_pos, freqs, mask, cache) -> torch.Tensor:
    bsz, seqlen, _ = x.size()
    end_pos = start_pos + seqlen
    q = _linear(_rms(attn.q_norm, _linear(x, attn.wq_a)), attn.wq_b).view(bsz, seqlen, attn.n_heads, attn.qk_head_dim)
    q_nope, q_pe = torch.split(q, [attn.qk_nope_head_dim, attn.qk_rope_head_dim], dim=-1)
    q_pe = _rotary(q_pe, freqs)
    kv, k_pe = torch.split(_linear(x, attn.wkv_a), [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    k_pe = _rotary(k_pe.unsqueeze(2), freqs)
    wkv_b = _dequant(attn.wkv_b).view(attn.n_heads, -1, attn.kv_lora_rank)
    q_nope = torch.einsum("bshd,hdc->bshc", q_nope, wkv_b[:, : attn.qk_nope_head_dim])
    cache["kv"][:bsz, start_pos:end_pos] = _rms(attn.kv_norm, kv)
    cache["pe"][:bsz, start_pos:end_pos] = k_pe.squeeze(2)
    scores = (
        torch.einsum("bshc,btc->bsht", q_nope, cache["kv"][:bsz, :end_pos])
        + torch.einsum("bshr,btr->bsht", q_pe, cache["pe"][:bsz, :end_pos])
    ) * attn.softmax_scale
    if mask is not None:
        scores += mask.unsqueeze(1)
    scores = scores.softmax(dim=-1, dtype=torch.float32).type_as(x)
    out = torch.einsum("bsht,btc->bshc", scores, cache["kv"][:bsz, :end_pos])
    out = torch.einsum("bshc,hdc->bshd", out, wkv_b[:, -attn.v_head_dim :])
    return _linear(out.flatten(2), attn.wo)


def _mlp(mlp, x):
    return _linear(F.silu(_linear(x, mlp.w1)) * _linear(x, mlp.w3), mlp.w2)


def _moe(moe, x):
    shape = x.size()
    x = x.view(-1, moe.dim)
    gate = moe.gate
    scores = F.linear(x, gate.weight).sigmoid()  # bfloat16 product and sigmoid
    original = scores
    scores = scores + gate.bias
    scores = scores.view(x.size(0), gate.n_groups, -1)
    group_scores = scores.topk(2, dim=-1)[0].sum(dim=-1)
    indices = group_scores.topk(gate.topk_groups, dim=-1)[1]
    mask = scores.new_ones(x.size(0), gate.n_groups, dtype=bool).scatter_(1, indices, False)
    scores = scores.masked_fill_(mask.unsqueeze(-1), float("-inf")).flatten(1)
    indices = torch.topk(scores, gate.topk, dim=-1)[1]
    weights = original.gather(1, indices)
    weights /= weights.sum(dim=-1, keepdim=True)
    weights *= gate.route_scale
    weights = weights.type_as(x)
    y = torch.zeros_like(x)
    for i in range(moe.n_routed_experts):
        idx, top = torch.where(indices == i)
        if len(idx):
            y[idx] += _mlp(moe.experts[i], x[idx]) * weights[idx, top, None]
    return (y + _mlp(moe.shared_experts, x)).view(shape)


def _reference(model, tokens, start_pos, caches) -> torch.Tensor:
    """V3's Transformer.forward: bfloat16 logits of the last position."""
    seqlen = tokens.size(1)
    h = F.embedding(tokens, model.embed.weight)
    freqs = precompute_freqs_cis(model.args, start_pos + seqlen, tokens.device, start=start_pos)
    mask = torch.full((seqlen, seqlen), float("-inf")).triu_(1) if seqlen > 1 else None
    for block, cache in zip(model.layers, caches, strict=True):
        h = h + _mla(block.attn, _rms(block.attn_norm, h), start_pos, freqs, mask, cache)
        f = _rms(block.ffn_norm, h)
        h = h + (_moe(block.ffn, f) if hasattr(block.ffn, "gate") else _mlp(block.ffn, f))
    return F.linear(_rms(model.norm, h)[:, -1], model.head.weight.to(torch.bfloat16))


@pytest.mark.parametrize("route", ["plain", "cpu"])
def test_forward_is_v3_reference_bit_for_bit(route):
    """Prefill and two decode steps, batch of two: the logits are V3's reference's to the bit."""
    model = load_model(SyntheticSource(V3, seed=5))
    tokens = torch.randint(0, V3.vocab_size, (2, 11))
    args = model.args
    caches = [
        {
            "kv": torch.zeros(2, 16, args.kv_lora_rank, dtype=torch.bfloat16),
            "pe": torch.zeros(2, 16, args.qk_rope_head_dim, dtype=torch.bfloat16),
        }
        for _ in model.layers
    ]
    cache = model.new_cache()
    with kernels.plain() if route == "plain" else kernels.serial_passes():
        ours = [model(tokens[:, :9], cache=cache), *(model(tokens[:, p : p + 1], start_pos=p, cache=cache) for p in (9, 10))]
    with torch.inference_mode():
        want = [
            _reference(model, tokens[:, :9], 0, caches),
            *(_reference(model, tokens[:, p : p + 1], p, caches) for p in (9, 10)),
        ]
    for got, ref in zip(ours, want, strict=True):
        assert got.dtype == torch.float32 and torch.equal(got, ref.float())
