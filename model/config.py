"""The model's hyper-parameters: one dataclass, read from either JSON form of the checkpoint.

Field names follow the reference's ``ModelArgs`` (``dim``, ``n_dense_layers``, ...), so the code
reads like the official inference code; :meth:`ModelArgs.from_hf` maps a Hugging Face
``config.json`` (``hidden_size``, ``first_k_dense_replace``, ...) onto them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .files import FileError, read_json
from .names import FAMILIES


class ConfigError(ValueError):
    """A configuration file that cannot describe a DeepSeek-V3 or V3.2 model."""


INDEX_KEYS = ("index_n_heads", "index_head_dim", "index_topk")  # a config with none of them has no indexer


@dataclass(frozen=True)
class ModelArgs:
    """DeepSeek-V3.2 architecture; defaults are the reference's ``ModelArgs`` defaults."""

    # vocabulary and widths
    vocab_size: int = 102400
    dim: int = 2048  # d, the residual stream width
    inter_dim: int = 10944  # hidden width of the dense MLP blocks
    moe_inter_dim: int = 1408  # hidden width of one expert
    n_layers: int = 27  # transformer blocks (the MTP module not included)
    n_dense_layers: int = 1  # the first blocks use a dense MLP instead of MoE
    n_heads: int = 16
    norm_eps: float = 1e-6
    # mixture of experts
    n_routed_experts: int = 64
    n_shared_experts: int = 2
    n_activated_experts: int = 6  # k, experts per token
    n_expert_groups: int = 1
    n_limited_groups: int = 1  # groups a token may route to
    score_func: str = "softmax"  # "softmax" | "sigmoid"
    route_scale: float = 1.0
    # Whether the routers carry e_score_correction_bias (has_gate_bias decides, everywhere): a checkpoint's
    # tensors say (SafetensorsSource sets it when it opens one); a config alone from topk_method ("noaux_tc"),
    # or, for the reference's JSON (None here), from score_func == "sigmoid".
    gate_bias: bool | None = None
    # multi-head latent attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # rotary embedding with YaRN
    max_seq_len: int = 4096 * 4  # the reference applies YaRN only when this exceeds original_seq_len
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    # lightning indexer (DeepSeek Sparse Attention); ``indexer`` False is the parent architecture
    # (DeepSeek-V3, R1, V3.1: model_type deepseek_v3, no index_* keys), whose index_* values are unused
    indexer: bool = True
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 2048
    # storage
    dtype: str = "bf16"  # weights of the linear layers: "fp8" (e4m3, 128x128 block scales) | "bf16"
    scale_fmt: str | None = None  # "ue8m0": power-of-two activation scales
    n_mtp_layers: int = 0  # multi-token-prediction modules stored after the blocks (not run)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()  # every id that ends a generation (Hugging Face gives one id or a list)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_id", _token_ids("eos_token_id", self.eos_token_id))
        if self.indexer is False:  # unused: the defaults, so that two configs without an indexer compare equal
            for f in dataclasses.fields(self):
                if f.name in INDEX_KEYS:
                    object.__setattr__(self, f.name, f.default)
        wrong = _wrong_types(self)
        if wrong:  # the range checks below would fail on them with a TypeError
            raise ConfigError("; ".join(wrong))
        too_large = _too_large(self)
        if too_large:  # before any product of sizes is formed
            raise ConfigError("; ".join(too_large))
        problems = []
        if self.q_lora_rank <= 0:
            problems.append("q_lora_rank must be positive (the query latent; a single wq is not supported)")
        if self.n_routed_experts % max(self.n_expert_groups, 1):
            problems.append("n_routed_experts must be a multiple of n_expert_groups")
        if not 0 < self.n_limited_groups <= self.n_expert_groups:
            problems.append("n_limited_groups must be between 1 and n_expert_groups")
        if self.n_activated_experts > self.n_routed_experts:
            problems.append("n_activated_experts exceeds n_routed_experts")
        if self.qk_rope_head_dim % 2:
            problems.append("qk_rope_head_dim must be even")
        if self.indexer and self.qk_rope_head_dim > self.index_head_dim:
            problems.append("qk_rope_head_dim must be at most index_head_dim")
        if self.indexer and self.index_head_dim & (self.index_head_dim - 1):
            problems.append("index_head_dim must be a power of two (Hadamard rotation)")
        if self.score_func not in ("softmax", "sigmoid"):
            problems.append(f"score_func must be softmax or sigmoid, not {self.score_func!r}")
        if self.dtype not in ("fp8", "bf16"):
            problems.append(f"dtype must be fp8 or bf16, not {self.dtype!r}")
        if self.scale_fmt not in (None, "ue8m0"):
            problems.append(f"scale_fmt must be ue8m0 or absent, not {self.scale_fmt!r}")
        for name in _POSITIVE:  # without the indexer its keys hold their (positive) defaults
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, not {getattr(self, name)}")
        if self.bos_token_id is not None and self.bos_token_id < 0:
            problems.append(f"bos_token_id must be 0 or more, not {self.bos_token_id}")
        if any(i < 0 for i in self.eos_token_id):
            problems.append(f"eos_token_id must be ids of 0 or more, not {list(self.eos_token_id)}")
        for name in ("n_dense_layers", "n_shared_experts", "n_mtp_layers"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be 0 or more, not {getattr(self, name)}")
        # NaN compares false with everything, so each bound is written to fail on it
        if not (_finite(self.norm_eps) and self.norm_eps > 0):
            problems.append(f"norm_eps must be a positive finite number, not {self.norm_eps}")
        if not (_finite(self.rope_theta) and self.rope_theta > 1):
            problems.append(f"rope_theta must be a finite number above 1 (YaRN divides by its log), not {self.rope_theta}")
        if not (_finite(self.rope_factor) and self.rope_factor > 0):
            problems.append(f"rope_factor must be a positive finite number, not {self.rope_factor}")
        for name in ("route_scale", "mscale"):
            if not _finite(getattr(self, name)):
                problems.append(f"{name} must be a finite number, not {getattr(self, name)}")
        if problems:
            raise ConfigError("; ".join(problems))

    # derived quantities ------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def n_moe_layers(self) -> int:
        return max(self.n_layers - self.n_dense_layers, 0)

    @property
    def use_yarn(self) -> bool:
        """The reference extends RoPE with YaRN only when max_seq_len > original_seq_len."""
        return self.max_seq_len > self.original_seq_len

    @property
    def softmax_scale(self) -> float:
        """MLA's 1/sqrt(d_qk), times YaRN's mscale squared when YaRN is on."""
        scale = self.qk_head_dim**-0.5
        if self.use_yarn:
            mscale = 0.1 * self.mscale * math.log(self.rope_factor) + 1.0
            scale = scale * mscale * mscale
        return scale

    @property
    def has_indexer(self) -> bool:
        """Whether the blocks have the lightning indexer (V3.2). Without it the model is DeepSeek-V3's
        architecture, computed as V3's reference computes it (docs/numerics.md)."""
        return self.indexer

    @property
    def model_type(self) -> str:
        """The Hugging Face model_type, which names the model's family (model.names.FAMILIES)."""
        return "deepseek_v32" if self.indexer else "deepseek_v3"

    @property
    def has_gate_bias(self) -> bool:
        return bool(self.gate_bias) if self.gate_bias is not None else self.score_func == "sigmoid"

    @property
    def experts_per_group(self) -> int:
        return self.n_routed_experts // self.n_expert_groups

    def is_eos(self, token_id: int) -> bool:
        """Whether ``token_id`` ends a generation: any of the configured ids does."""
        return token_id in self.eos_token_id

    def is_moe(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    def replace(self, **changes: Any) -> ModelArgs:
        return dataclasses.replace(self, **changes)

    # JSON forms ---------------------------------------------------------------------------
    @classmethod
    def from_reference(cls, data: dict[str, Any]) -> ModelArgs:
        """The reference's own JSON (``inference/config_671B_v3.2.json``, or V3's ``config_671B.json``,
        which has no index_* keys: no indexer)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, not {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "indexer"}
        args = {k: v for k, v in data.items() if k in known}
        args["indexer"] = any(k in data for k in INDEX_KEYS)
        extra = {k: v for k, v in data.items() if k not in known}
        if "max_batch_size" in extra:
            extra.pop("max_batch_size")
        return _build(cls, args, extra)

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> ModelArgs:
        """A Hugging Face ``config.json`` of model_type ``deepseek_v32`` (with the indexer's index_*
        keys) or ``deepseek_v3`` (DeepSeek-V3, R1, V3.1: none, no indexer).

        Messages do not name the file: :meth:`from_file` prefixes its path once."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, not {type(data).__name__}")
        model_type = data.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(f"model_type is {model_type!r}, expected {' or '.join(map(repr, FAMILIES))}")
        indexer = model_type == "deepseek_v32" or any(k in data for k in INDEX_KEYS)

        def need(key: str) -> Any:
            if key not in data:
                raise ConfigError(f"missing field {key!r}")
            return data[key]

        quant = data.get("quantization_config") or {}
        if not isinstance(quant, dict):
            raise ConfigError(f"quantization_config must be an object, not {quant!r}")
        if quant:
            if quant.get("quant_method", "fp8") != "fp8" or quant.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"unsupported quantization_config {quant}")
            block = quant.get("weight_block_size", [128, 128])
            if not isinstance(block, (list, tuple)) or list(block) != [128, 128]:
                raise ConfigError(f"weight_block_size {block}, expected [128, 128]")
        rope = data.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"rope_scaling must be an object or null, not {rope!r}")
        max_pos = need("max_position_embeddings")
        args: dict[str, Any] = dict(
            vocab_size=need("vocab_size"),
            dim=need("hidden_size"),
            inter_dim=need("intermediate_size"),
            moe_inter_dim=need("moe_intermediate_size"),
            n_layers=need("num_hidden_layers"),
            n_dense_layers=need("first_k_dense_replace"),
            n_heads=need("num_attention_heads"),
            norm_eps=data.get("rms_norm_eps", 1e-6),
            n_routed_experts=need("n_routed_experts"),
            n_shared_experts=need("n_shared_experts"),
            n_activated_experts=need("num_experts_per_tok"),
            n_expert_groups=need("n_group"),
            n_limited_groups=need("topk_group"),
            score_func=data.get("scoring_func", "sigmoid"),
            route_scale=data.get("routed_scaling_factor", 1.0),
            gate_bias=data.get("topk_method", "noaux_tc") == "noaux_tc",
            q_lora_rank=need("q_lora_rank"),
            kv_lora_rank=need("kv_lora_rank"),
            qk_nope_head_dim=need("qk_nope_head_dim"),
            qk_rope_head_dim=need("qk_rope_head_dim"),
            v_head_dim=need("v_head_dim"),
            max_seq_len=max_pos,
            rope_theta=data.get("rope_theta", 10000.0),
            indexer=indexer,
            **({key: need(key) for key in INDEX_KEYS} if indexer else {}),
            dtype="fp8" if quant else "bf16",
            scale_fmt=quant.get("scale_fmt") if quant else None,
            n_mtp_layers=data.get("num_nextn_predict_layers", 0),
            bos_token_id=data.get("bos_token_id"),
            eos_token_id=data.get("eos_token_id"),
        )
        if data.get("norm_topk_prob") is False and args["score_func"] == "sigmoid":
            raise ConfigError("norm_topk_prob false is not supported with sigmoid routing")
        if rope:
            kind = rope.get("type", rope.get("rope_type"))
            if kind != "yarn":
                raise ConfigError(f"rope_scaling type {kind!r} is not supported (yarn only)")
            args.update(
                original_seq_len=rope.get("original_max_position_embeddings", 4096),
                rope_factor=rope.get("factor", 1.0),
                beta_fast=rope.get("beta_fast", 32),
                beta_slow=rope.get("beta_slow", 1),
                mscale=rope.get("mscale_all_dim", rope.get("mscale", 1.0)),
            )
        else:  # plain RoPE: make the YaRN condition false
            args.update(original_seq_len=max_pos, rope_factor=1.0)
        return _build(cls, args, {"hf": data})

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelArgs:
        """Either form, told apart by ``model_type`` (only the Hugging Face form has one)."""
        if not isinstance(data, dict):
            raise ConfigError(f"a config must be a JSON object, not {type(data).__name__}")
        return cls.from_hf(data) if "model_type" in data else cls.from_reference(data)

    @classmethod
    def from_file(cls, path: str | Path) -> ModelArgs:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = read_json(path)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except FileError as exc:
            raise ConfigError(f"{path}: not a readable JSON config ({exc})") from None
        try:
            return cls.from_json(data)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    def to_reference(self) -> dict[str, Any]:
        """The reference's JSON form: exactly the fields of its ``ModelArgs`` (``ModelArgs(**this)``
        works there). It has no ``norm_eps``: its RMSNorms hard-code 1e-6."""
        skip = ("extra", "gate_bias", "n_mtp_layers", "bos_token_id", "eos_token_id", "norm_eps", "indexer")
        skip += () if self.indexer else INDEX_KEYS  # V3's ModelArgs has no index_* fields
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``config.json`` for this model: model_type ``deepseek_v32``, or
        ``deepseek_v3`` without the indexer (and without its index_* keys)."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV32ForCausalLM" if self.indexer else "DeepseekV3ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.dim,
            "intermediate_size": self.inter_dim,
            "moe_intermediate_size": self.moe_inter_dim,
            "num_hidden_layers": self.n_layers,
            "first_k_dense_replace": self.n_dense_layers,
            "moe_layer_freq": 1,
            "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_heads,
            "rms_norm_eps": self.norm_eps,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.n_activated_experts,
            "n_group": self.n_expert_groups,
            "topk_group": self.n_limited_groups,
            "scoring_func": self.score_func,
            "routed_scaling_factor": self.route_scale,
            "topk_method": "noaux_tc" if self.has_gate_bias else "greedy",
            "norm_topk_prob": True,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "max_position_embeddings": self.max_seq_len,
            "rope_theta": self.rope_theta,
            **({key: getattr(self, key) for key in INDEX_KEYS} if self.indexer else {}),
            "num_nextn_predict_layers": self.n_mtp_layers,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            out["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else list(self.eos_token_id)
        if self.use_yarn:
            out["rope_scaling"] = {
                "type": "yarn",
                "factor": self.rope_factor,
                "original_max_position_embeddings": self.original_seq_len,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "mscale": self.mscale,
                "mscale_all_dim": self.mscale,
            }
        else:
            out["rope_scaling"] = None
        if self.dtype == "fp8":
            quant: dict[str, Any] = {
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "quant_method": "fp8",
                "weight_block_size": [128, 128],
            }
            if self.scale_fmt:
                quant["scale_fmt"] = self.scale_fmt
            out["quantization_config"] = quant
        return out


def _build(cls: type[ModelArgs], args: dict[str, Any], extra: dict[str, Any]) -> ModelArgs:
    """JSON writes integers as 16384.0 at times: those become ints, everything else is checked by
    ``__post_init__``."""
    types = {f.name: f.type for f in dataclasses.fields(cls)}
    for key, value in args.items():
        if types[key] in ("int", "int | None") and isinstance(value, float) and value.is_integer():
            args[key] = int(value)
    return cls(**args, extra=extra)


# sizes the model divides by or builds tensors of: zero or below is no model
_POSITIVE = (
    "vocab_size",
    "dim",
    "inter_dim",
    "moe_inter_dim",
    "n_layers",
    "n_heads",
    "n_routed_experts",
    "n_activated_experts",
    "n_expert_groups",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "max_seq_len",
    "original_seq_len",
    "beta_fast",
    "beta_slow",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
)


def _finite(value: float) -> bool:
    """math.isfinite, but an integer too large for a float (JSON allows 400 digits) is not finite."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _token_ids(name: str, value: Any) -> tuple[int, ...]:
    """One id, a list of ids or none (null), as Hugging Face writes eos_token_id, as a tuple."""
    ids = () if value is None else tuple(value) if isinstance(value, (list, tuple)) else (value,)
    if not all(_is_int(i) for i in ids):
        raise ConfigError(f"{name} must be a token id or a list of token ids, not {_short(value)}")
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: Any) -> str:
    """A value for a one-line message: a 500-digit number or a long list is cut."""
    if _is_int(value) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# No model this program can hold comes near these bounds. Checked first, they keep every product of
# sizes small (a tensor's element count stays far inside int64: three widths multiply to under
# 2^63) and keep a crafted config from building millions of modules on the meta device: the
# blocks and the routed experts of all blocks (the 671B model has 58 x 256 = 14,848) are Python
# objects there too.
MAX_WIDTH = 2**20  # any width, count or head size (the 671B model's largest: 129,280, its vocabulary)
MAX_POSITION = 2**31 - 1  # sequence lengths and token ids
MAX_LAYERS = 1024
MAX_EXPERT_MODULES = 65536
_POSITIONS = ("max_seq_len", "original_seq_len", "bos_token_id")


def _too_large(args: ModelArgs) -> list[str]:
    out = []
    for f in dataclasses.fields(args):
        value, bound = getattr(args, f.name), MAX_POSITION if f.name in _POSITIONS else MAX_WIDTH
        if f.type in ("int", "int | None") and value is not None and value > bound:
            out.append(f"{f.name} must be at most {bound}, not {_short(value)}")
    out += [f"eos_token_id must be at most {MAX_POSITION}, not {_short(i)}" for i in args.eos_token_id if i > MAX_POSITION][:1]
    if out:
        return out
    if args.n_layers + args.n_mtp_layers > MAX_LAYERS:
        out.append(f"{args.n_layers} blocks and {args.n_mtp_layers} MTP modules: more than {MAX_LAYERS} blocks in all")
    experts = max(args.n_layers - args.n_dense_layers, 0) * args.n_routed_experts
    if experts > MAX_EXPERT_MODULES:
        out.append(f"{experts} routed experts in all (MoE blocks x experts): more than {MAX_EXPERT_MODULES}")
    return out


def _wrong_types(args: ModelArgs) -> list[str]:
    """A JSON string or list where a number belongs, or a number where a name belongs."""
    wrong = []
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.type == "int":
            ok = _is_int(value)
            kind = "an integer"
        elif f.type == "int | None":
            ok = value is None or _is_int(value)
            kind = "an integer or null"
        elif f.type == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            kind = "a number"
        elif f.type in ("str", "str | None"):
            ok = isinstance(value, str) or (value is None and f.type == "str | None")
            kind = "a string"
        elif f.type == "bool":
            ok = isinstance(value, bool)
            kind = "true or false"
        elif f.type == "bool | None":
            ok = value is None or isinstance(value, bool)
            kind = "true, false or null"
        else:
            continue
        if not ok:
            wrong.append(f"{f.name} must be {kind}, not {_short(value)}")
    return wrong


# A tiny configuration for tests: every mechanism active (query LoRA, YaRN, grouped sigmoid
# routing with the correction bias, a dense first block, an indexer that prunes), widths that are
# multiples of the 128 FP8 block, and a 192-row kv_a projection whose last weight block is partial.
TINY = ModelArgs(
    vocab_size=512,
    dim=256,
    inter_dim=384,
    moe_inter_dim=128,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    n_routed_experts=16,
    n_shared_experts=1,
    n_activated_experts=4,
    n_expert_groups=4,
    n_limited_groups=2,
    score_func="sigmoid",
    route_scale=2.5,
    gate_bias=True,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=8,
    dtype="fp8",
    scale_fmt="ue8m0",
)


# A mid-size configuration for benchmarks and tests: every mechanism of the real model at widths
# that are multiples of the 128 FP8 block (kv_a_proj's 256 + 64 = 320 rows end in a partial block,
# as the real 576 do), 64 experts in 8 groups, plain RoPE (max_seq_len = original_seq_len).
MID = ModelArgs(
    vocab_size=16384,
    dim=1024,
    inter_dim=2816,
    moe_inter_dim=256,
    n_layers=8,
    n_dense_layers=1,
    n_heads=8,
    n_routed_experts=64,
    n_shared_experts=1,
    n_activated_experts=6,
    n_expert_groups=8,
    n_limited_groups=4,
    score_func="sigmoid",
    route_scale=2.5,
    gate_bias=True,
    q_lora_rank=512,
    kv_lora_rank=256,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_seq_len=4096,
    original_seq_len=4096,
    rope_factor=1.0,
    index_n_heads=16,
    index_head_dim=128,
    index_topk=256,
    dtype="fp8",
    scale_fmt="ue8m0",
)
