"""Checkpoint names: the one table between the Hugging Face layout and the module paths.

``model.layers.3.self_attn.q_a_proj.weight_scale_inv``  <->  ``layers.3.attn.wq_a.scale``
"""

from __future__ import annotations

import re

# Top-level pieces (the first segment of a module path), then the pieces inside a block; a piece
# is a whole dotted segment. Inside the indexer both layouts use the same names.
TOP: tuple[tuple[str, str], ...] = (
    ("embed", "model.embed_tokens"),
    ("norm", "model.norm"),
    ("head", "lm_head"),
    ("layers", "model.layers"),
)
INNER: tuple[tuple[str, str], ...] = (
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn", "self_attn"),
    ("wq_a", "q_a_proj"),
    ("q_norm", "q_a_layernorm"),
    ("wq_b", "q_b_proj"),
    ("wkv_a", "kv_a_proj_with_mqa"),
    ("kv_norm", "kv_a_layernorm"),
    ("wkv_b", "kv_b_proj"),
    ("wo", "o_proj"),
    ("ffn", "mlp"),
    ("w1", "gate_proj"),
    ("w2", "down_proj"),
    ("w3", "up_proj"),
    ("scale", "weight_scale_inv"),
)
_GATE_BIAS = ("gate.bias", "gate.e_score_correction_bias")
# Parameters the checkpoint stores in another dtype than the reference's module holds them: the
# module keeps float32 (the products are formed in float32), the file has bfloat16. Every other
# parameter is stored as the module holds it.
STORED_BF16 = ("head.weight", "indexer.weights_proj.weight")
_TOP_TO_HF = dict(TOP)
_TOP_FROM_HF = {hf: ours for ours, hf in TOP}
_TO_HF = dict(INNER)
_FROM_HF = {hf: ours for ours, hf in INNER}


def to_hf(name: str) -> str:
    """Module path of a parameter -> its checkpoint name."""
    top, _, rest = name.partition(".")
    parts = rest.split(".") if rest else []
    if top == "layers" and len(parts) > 2 and parts[1:3] == ["attn", "indexer"]:
        inner = parts[:3] + [p.replace("scale", "weight_scale_inv") for p in parts[3:]]
        parts = [parts[0], "self_attn", "indexer"] + inner[3:]
    else:
        parts = [_TO_HF.get(p, p) for p in parts]
    out = ".".join([_TOP_TO_HF.get(top, top), *parts])
    return out.replace(_GATE_BIAS[0], _GATE_BIAS[1]) if out.endswith(_GATE_BIAS[0]) else out


def from_hf(name: str) -> str:
    """Checkpoint name -> module path."""
    hf_top = next((t for t in _TOP_FROM_HF if name == t or name.startswith(t + ".")), None)
    if hf_top is None:
        return name
    top, rest = _TOP_FROM_HF[hf_top], name[len(hf_top) + 1 :]
    if name.endswith(_GATE_BIAS[1]):
        rest = rest[: -len(_GATE_BIAS[1])] + _GATE_BIAS[0]
    parts = rest.split(".") if rest else []
    if top == "layers" and len(parts) > 2 and parts[1:3] == ["self_attn", "indexer"]:
        parts = [parts[0], "attn", "indexer"] + [p.replace("weight_scale_inv", "scale") for p in parts[3:]]
    else:
        parts = [_FROM_HF.get(p, p) for p in parts]
    return ".".join([top, *parts])


def layer_of(hf_name: str) -> int | None:
    """The block index of a checkpoint name, None for the embedding, final norm and head."""
    m = re.match(r"model\.layers\.(\d+)\.", hf_name)
    return int(m.group(1)) if m else None
