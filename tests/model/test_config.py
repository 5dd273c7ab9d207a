import json

import pytest

from model.config import TINY, ConfigError, ModelArgs

HF = "assets/configs/config_671B_hf.json"
REF = "assets/configs/config_671B_v3.2.json"


def test_both_forms_of_the_671b_config_describe_the_same_model():
    hf, ref = ModelArgs.from_file(HF), ModelArgs.from_file(REF)
    for name in (
        "vocab_size",
        "dim",
        "inter_dim",
        "moe_inter_dim",
        "n_layers",
        "n_dense_layers",
        "n_heads",
        "n_routed_experts",
        "n_shared_experts",
        "n_activated_experts",
        "n_expert_groups",
        "n_limited_groups",
        "route_scale",
        "score_func",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "original_seq_len",
        "rope_theta",
        "rope_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "dtype",
        "scale_fmt",
    ):
        assert getattr(hf, name) == getattr(ref, name), name
    assert hf.use_yarn and ref.use_yarn
    assert hf.has_gate_bias and ref.has_gate_bias
    assert hf.softmax_scale == pytest.approx(192**-0.5 * (0.1 * __import__("math").log(40) + 1) ** 2)


# the fields of the reference's ModelArgs (inference/model.py): its generate.py calls ModelArgs(**json)
REFERENCE_FIELDS = {
    *("max_batch_size", "max_seq_len", "dtype", "scale_fmt", "vocab_size", "dim", "inter_dim", "moe_inter_dim"),
    *("n_layers", "n_dense_layers", "n_heads", "n_routed_experts", "n_shared_experts", "n_activated_experts"),
    *("n_expert_groups", "n_limited_groups", "score_func", "route_scale", "q_lora_rank", "kv_lora_rank"),
    *("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "original_seq_len", "rope_theta", "rope_factor"),
    *("beta_fast", "beta_slow", "mscale", "index_n_heads", "index_head_dim", "index_topk"),
}


def test_reference_form_is_what_the_reference_reads():
    out = ModelArgs.from_file(HF).to_reference()
    assert set(out) <= REFERENCE_FIELDS  # e.g. no norm_eps: the reference hard-codes 1e-6
    shipped = json.loads(open(REF).read())
    assert {k: out[k] for k in shipped} == shipped
    assert ModelArgs.from_reference(TINY.to_reference()) == TINY.replace(norm_eps=1e-6, gate_bias=None)


def test_hf_round_trip_keeps_the_architecture():
    again = ModelArgs.from_hf(TINY.to_hf())
    assert again == TINY.replace(max_seq_len=again.max_seq_len, gate_bias=True)
    assert again.use_yarn == TINY.use_yarn


def test_missing_field_is_named(tmp_path):
    data = json.loads(open(HF).read())
    del data["index_topk"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="index_topk"):
        ModelArgs.from_file(path)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_size": "big"}, "dim must be an integer"),
        ({"n_group": 3}, "multiple of n_expert_groups"),
        ({"q_lora_rank": 0}, "q_lora_rank"),
    ],
)
def test_bad_fields_are_rejected(change, message):
    data = json.loads(open(HF).read()) | change
    with pytest.raises(ConfigError, match=message):
        ModelArgs.from_hf(data)


def test_plain_rope_without_rope_scaling():
    data = json.loads(open(HF).read()) | {"rope_scaling": None}
    args = ModelArgs.from_hf(data)
    assert not args.use_yarn and args.softmax_scale == pytest.approx(192**-0.5)
