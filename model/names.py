"""Checkpoint names: the one table between the Hugging Face layout and the module paths.

``model.layers.3.self_attn.q_a_proj.weight_scale_inv``  <->  ``layers.3.attn.wq_a.scale``
"""

from __future__ import annotations

import re
from typing import NamedTuple

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


class Family(NamedTuple):
    """A model family: the module of model/ whose ``Transformer`` builds it, and the parameters (by
    the ending of their module path) its checkpoints store in bfloat16 where the module holds float32."""

    module: str
    stored_bf16: tuple[str, ...]


# A config's model_type -> its family. DeepSeek-V3 (R1, V3.1: no indexer) stores its norm gains in
# bfloat16 too, where V3.2's are float32.
FAMILIES: dict[str, Family] = {
    "deepseek_v32": Family("transformer", STORED_BF16),
    "deepseek_v3": Family("v3", STORED_BF16 + ("norm.weight",)),
}
_TOP_TO_HF = dict(TOP)
_TOP_FROM_HF = {hf: ours for ours, hf in TOP}
_TO_HF = dict(INNER)
_FROM_HF = {hf: ours for ours, hf in INNER}


# The MTP module (model.mtp.{j}, model/mtp.py) is stored after the blocks, as block n_layers + j:
# its own pieces by these names, its block's parameters as a block's. embed_tokens and
# shared_head.head are copies of the main model's embedding and head (the module uses those).
MTP_OWN: tuple[tuple[str, str], ...] = (
    ("enorm", "enorm"),
    ("hnorm", "hnorm"),
    ("eh_proj", "eh_proj"),
    ("norm", "shared_head.norm"),
)
MTP_SHARED: tuple[tuple[str, str], ...] = (("embed.weight", "embed_tokens.weight"), ("head.weight", "shared_head.head.weight"))
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")


def to_hf(name: str, n_layers: int | None = None) -> str:
    """Module path of a parameter -> its checkpoint name. An MTP module's (``mtp.0.*``) needs the
    main model's block count ``n_layers``: it is stored as block ``n_layers``."""
    if (m := _MTP.fullmatch(name)) is not None:
        if n_layers is None:
            raise ValueError(f"{name}: an MTP module's checkpoint name needs the model's block count")
        layer, rest = n_layers + int(m.group(1)), m.group(2)
        if rest.startswith("block."):
            return to_hf(f"layers.{layer}.{rest.removeprefix('block.')}")
        for ours, hf in MTP_OWN + MTP_SHARED:
            if rest == ours or rest.startswith(ours + "."):
                return f"model.layers.{layer}.{hf}{rest[len(ours) :]}"
        return f"model.layers.{layer}.{rest}"
    top, _, rest = name.partition(".")
    parts = rest.split(".") if rest else []
    if top == "layers" and len(parts) > 2 and parts[1:3] == ["attn", "indexer"]:
        inner = parts[:3] + [p.replace("scale", "weight_scale_inv") for p in parts[3:]]
        parts = [parts[0], "self_attn", "indexer"] + inner[3:]
    else:
        parts = [_TO_HF.get(p, p) for p in parts]
    out = ".".join([_TOP_TO_HF.get(top, top), *parts])
    return out.replace(_GATE_BIAS[0], _GATE_BIAS[1]) if out.endswith(_GATE_BIAS[0]) else out


def from_hf(name: str, n_layers: int | None = None) -> str:
    """Checkpoint name -> module path. With ``n_layers``, a block at or after it is an MTP module's
    (``mtp.{j}.*``; its embed_tokens and shared_head.head copies name ``mtp.{j}.embed`` and ``head``)."""
    if n_layers is not None and (layer := layer_of(name)) is not None and layer >= n_layers:
        rest = name.removeprefix(f"model.layers.{layer}.")
        for ours, hf in MTP_OWN + MTP_SHARED:
            if rest == hf or rest.startswith(hf + "."):
                return f"mtp.{layer - n_layers}.{ours}{rest[len(hf) :]}"
        inner = from_hf(name).removeprefix(f"layers.{layer}.")
        return f"mtp.{layer - n_layers}.block.{inner}"
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
