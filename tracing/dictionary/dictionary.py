"""A sparse dictionary over one site: a TopK sparse autoencoder or a transcoder, in SAELens's format.

A sparse autoencoder (kind "sae") reads a residual site and reconstructs it; a transcoder (kind
"transcoder") reads a block's FFN input, the normed stream the FFN sees, and predicts the FFN's
output (``layers.{i}.ffn_out``). Both are TopK dictionaries (Gao et al. 2024): the k largest
pre-activations, through a ReLU, are a position's features, the rest are 0.

On disk a dictionary is a directory holding ``cfg.json`` and ``sae_weights.safetensors`` laid out
as SAELens 6 writes them (``SAE.save_model``): architecture "topk" for an autoencoder and
"transcoder" for a transcoder, the site as ``metadata.hook_name``. SAELens's transcoder has no
TopK (its encode is a plain ReLU), so a transcoder's k travels as ``k`` beside its keys: SAELens
ignores it, and a SAELens transcoder without one loads here with k = its width (TopK over every
feature is the ReLU). A directory is read as untrusted input: sizes from cfg.json and the
safetensors header are checked before a tensor is read, and nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from model.config import ModelArgs

from ..errors import InputError

CFG_NAME = "cfg.json"
WEIGHTS_NAME = "sae_weights.safetensors"
FORMAT_VERSION = "6.54.12"  # the SAELens release whose save_model this layout matches (>= 6: no renaming)
MAX_CFG_BYTES = 1 << 20
MAX_HEADER_BYTES = 1 << 16  # four tensors' entries take a few hundred bytes
MAX_WIDTH = 1 << 24  # features or stream width; a real model's dim is 7168
MAX_WEIGHT_BYTES = 16 << 30

KINDS = ("sae", "transcoder")
# the sites an autoencoder reads: the block's float32 stream and its updates, "B T D"
SAE_SITES = ("resid_pre", "attn_out", "resid_mid", "ffn_out", "resid_post")
_SAE_SITE = re.compile(r"layers\.(\d+)\.(" + "|".join(SAE_SITES) + r")")
_FFN_SITE = re.compile(r"layers\.(\d+)\.ffn")
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class DictionaryError(InputError):
    """A dictionary directory, or a dictionary for a model, that cannot be used: one line."""


def site_layer(kind: str, site: str) -> int:
    """The block a dictionary's site is in; DictionaryError for a site its kind cannot read."""
    pattern, example = (_SAE_SITE, "layers.3.resid_post") if kind == "sae" else (_FFN_SITE, "layers.3.ffn")
    match = pattern.fullmatch(site) if isinstance(site, str) else None
    if match is None:
        what = "a block's stream site" if kind == "sae" else "a block's FFN"
        raise DictionaryError(f"a {kind} reads {what} ({example}), not {site!r}")
    return int(match.group(1))


class Dictionary(nn.Module):
    """``encode(x) = TopK(ReLU((x - b_dec) @ W_enc + b_enc))`` (no ``- b_dec`` for a transcoder,
    whose b_dec lives in the output space), ``decode(f) = f @ W_dec + b_dec``; parameters float32
    with SAELens's names and shapes. Decoder rows are kept at unit norm by training, so a feature's
    activation is its direction's coefficient."""

    def __init__(
        self,
        kind: str,
        site: str,
        d_in: int,
        n_features: int,
        k: int,
        d_out: int | None = None,
        *,
        apply_b_dec_to_input: bool | None = None,
        metadata: dict | None = None,
    ):
        super().__init__()
        if kind not in KINDS:
            raise DictionaryError(f"a dictionary's kind is one of {', '.join(KINDS)}, not {kind!r}")
        self.layer = site_layer(kind, site)
        d_out = d_in if d_out is None else d_out
        for name, value in (("d_in", d_in), ("d_out", d_out), ("features", n_features)):
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_WIDTH:
                raise DictionaryError(f"{name} must be a whole number from 1 to {MAX_WIDTH:,}, not {value!r}")
        if not isinstance(k, int) or isinstance(k, bool) or not 0 < k <= n_features:
            raise DictionaryError(f"k must be a whole number from 1 to the {n_features:,} features, not {k!r}")
        if 4 * (d_in + d_out + 1) * n_features > MAX_WEIGHT_BYTES:  # checked before anything is allocated
            raise DictionaryError(f"{d_in} -> {n_features} -> {d_out} is over {MAX_WEIGHT_BYTES / 2**30:.3g} GiB of weights")
        if kind == "sae" and d_out != d_in:
            raise DictionaryError(f"an autoencoder reconstructs its input: d_out {d_out} != d_in {d_in}")
        self.kind, self.site = kind, site
        self.out_site = site if kind == "sae" else f"layers.{self.layer}.ffn_out"
        self.d_in, self.d_out, self.n_features, self.k = d_in, d_out, n_features, k
        # subtracting b_dec first centres an autoencoder's input; a transcoder's b_dec has d_out entries
        self.apply_b_dec_to_input = (kind == "sae") if apply_b_dec_to_input is None else bool(apply_b_dec_to_input)
        if self.apply_b_dec_to_input and kind != "sae":
            raise DictionaryError("a transcoder cannot subtract its decoder bias from its input")
        self.metadata = dict(metadata or {})
        self.W_enc = nn.Parameter(torch.zeros(d_in, n_features))
        self.b_enc = nn.Parameter(torch.zeros(n_features))
        self.W_dec = nn.Parameter(torch.zeros(n_features, d_out))
        self.b_dec = nn.Parameter(torch.zeros(d_out))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None, b_dec: torch.Tensor | None = None) -> Dictionary:
        """Gao et al.'s start: random unit-norm decoder rows, the encoder their transpose, b_enc 0 and
        b_dec the data's centre (its mean or geometric median) where given."""
        W = torch.randn(self.n_features, self.d_out, generator=generator)
        W /= W.norm(dim=-1, keepdim=True)
        self.W_dec.copy_(W)
        if self.d_in == self.d_out:
            self.W_enc.copy_(W.T)
        else:
            self.W_enc.copy_(torch.randn(self.d_in, self.n_features, generator=generator) / math.sqrt(self.d_in))
        self.b_enc.zero_()
        self.b_dec.copy_(torch.zeros(self.d_out) if b_dec is None else b_dec.float())
        return self

    def pre_acts(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., n_features) float32, before the ReLU and TopK."""
        x = x.float()
        if self.apply_b_dec_to_input:
            x = x - self.b_dec
        return x @ self.W_enc + self.b_enc

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_in) -> (..., n_features) float32: the k largest ReLU'd pre-activations, the rest 0."""
        return topk_relu(self.pre_acts(x), self.k)

    def decode(self, acts: torch.Tensor) -> torch.Tensor:
        """(..., n_features) -> (..., d_out) float32."""
        return acts.float() @ self.W_dec + self.b_dec

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(x))

    @torch.no_grad()
    def normalize_decoder(self) -> None:
        """Unit-norm decoder rows (training keeps them there after each step)."""
        self.W_dec /= self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12)

    @property
    def cfg(self) -> dict:
        """What cfg.json holds: SAELens's keys (its dataclass fields, "architecture", "metadata")
        and ours inside metadata, beside SAELens's own (hook_name)."""
        cfg = {
            "d_in": self.d_in,
            "d_sae": self.n_features,
            "dtype": "float32",
            "device": "cpu",
            "apply_b_dec_to_input": self.apply_b_dec_to_input,
            "normalize_activations": "none",
            "reshape_activations": "none",
            "k": self.k,
        }
        if self.kind == "sae":
            cfg.update(architecture="topk", rescale_acts_by_decoder_norm=False)
        else:
            cfg.update(architecture="transcoder", d_out=self.d_out)
        metadata = {"sae_lens_version": FORMAT_VERSION, "sae_lens_training_version": FORMAT_VERSION}
        metadata.update(self.metadata)
        metadata.update(hook_name=self.site, hook_name_out=self.out_site, kind=self.kind)
        cfg["metadata"] = metadata
        return cfg

    def extra_repr(self) -> str:
        return f"{self.kind} {self.site} -> {self.out_site}: {self.d_in} -> {self.n_features} (k={self.k}) -> {self.d_out}"


def topk_relu(pre: torch.Tensor, k: int) -> torch.Tensor:
    """(..., n) -> (..., n): the k largest entries of each row through a ReLU, every other entry 0
    (SAELens's TopK: the same values as a ReLU before the selection)."""
    values, indices = pre.topk(k, dim=-1, sorted=False)
    return torch.zeros_like(pre).scatter_(-1, indices, values.relu())


def save(d: Dictionary, directory: str | Path) -> Path:
    """Write ``cfg.json`` and ``sae_weights.safetensors`` into ``directory`` (made if missing)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().float().cpu().contiguous() for name, p in d.named_parameters()}
    save_file(tensors, directory / WEIGHTS_NAME)
    (directory / CFG_NAME).write_text(json.dumps(d.cfg, indent=2) + "\n")
    return directory


def load(directory: str | Path, *, device: str | torch.device = "cpu") -> Dictionary:
    """The dictionary in ``directory``; DictionaryError (one line) for anything it cannot be."""
    directory = Path(directory)
    cfg = _read_cfg(directory)
    with torch.device("meta"):  # shapes only: nothing is allocated until the file is known to hold them
        d = _from_cfg(cfg, directory)
    expected = {name: tuple(p.shape) for name, p in d.named_parameters()}
    weights = directory / WEIGHTS_NAME
    read_header(weights, expected)
    d = d.to_empty(device="cpu")
    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise DictionaryError(f"{weights}: not a readable safetensors file ({_line(exc)})") from None
    with torch.no_grad():
        for name, p in d.named_parameters():
            value = tensors[name].float()
            if not torch.isfinite(value).all():
                raise DictionaryError(f"{weights}: {name} holds NaN or infinite values")
            p.copy_(value)
    return d.to(device)


def check_fits(d: Dictionary, args: ModelArgs) -> None:
    """DictionaryError unless the model has the dictionary's block and its widths are the stream's."""
    if d.layer >= args.n_layers:
        raise DictionaryError(f"the dictionary reads {d.site}, but the model has {args.n_layers} blocks")
    if d.d_in != args.dim or d.d_out != args.dim:
        raise DictionaryError(f"the dictionary for {d.site} is {d.d_in} -> {d.d_out} wide, but the model's stream is {args.dim}")


def read_header(path: Path, expected: dict[str, tuple[int, ...]]) -> dict:
    """A safetensors file's header, checked against the tensors a dictionary has (names, shapes,
    a float dtype, offsets inside the file) before any tensor is read; DictionaryError otherwise."""
    if not path.is_file():
        raise DictionaryError(f"{path.parent}: no {path.name} (a dictionary holds {CFG_NAME} and {WEIGHTS_NAME})")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DictionaryError(f"{path}: not a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:  # refused before it is read: the length is the file's own claim
            raise DictionaryError(f"{path}: a {n:,}-byte header; a dictionary's is at most {MAX_HEADER_BYTES:,}")
        if 8 + n > size:
            raise DictionaryError(f"{path}: the header runs past the end of the file")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise DictionaryError(f"{path}: the header is not JSON") from None
    if not isinstance(header, dict):
        raise DictionaryError(f"{path}: the header is not a JSON object")
    names = set(header) - {"__metadata__"}
    if names != set(expected):
        raise DictionaryError(f"{path}: holds {sorted(names)}; a dictionary holds {sorted(expected)}")
    data = size - 8 - n
    for name, shape in expected.items():
        entry = header[name]
        if not isinstance(entry, dict) or entry.get("dtype") not in _DTYPES:
            raise DictionaryError(f"{path}: {name} is not a float tensor")
        if not isinstance(entry.get("shape"), list) or tuple(entry["shape"]) != shape:
            raise DictionaryError(f"{path}: {name} has shape {entry.get('shape')}, the cfg.json says {list(shape)}")
        offsets = entry.get("data_offsets")
        nbytes = math.prod(shape) * _DTYPES[entry["dtype"]].itemsize
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or offsets[1] - offsets[0] != nbytes
            or offsets[0] < 0
            or offsets[1] > data
        ):
            raise DictionaryError(f"{path}: {name}'s bytes do not match its shape or lie outside the file")
    return header


def _read_cfg(directory: Path) -> dict:
    if not directory.is_dir():
        raise DictionaryError(f"{directory}: no such dictionary directory")
    path = directory / CFG_NAME
    if not path.is_file():
        raise DictionaryError(f"{directory}: no {CFG_NAME} (a dictionary holds {CFG_NAME} and {WEIGHTS_NAME})")
    if path.stat().st_size > MAX_CFG_BYTES:
        raise DictionaryError(f"{path}: over {MAX_CFG_BYTES:,} bytes; a dictionary's config is a few hundred")
    try:
        cfg = json.loads(path.read_bytes())
    except (ValueError, RecursionError):
        raise DictionaryError(f"{path}: not JSON") from None
    if not isinstance(cfg, dict):
        raise DictionaryError(f"{path}: not a JSON object")
    return cfg


def _from_cfg(cfg: dict, directory: Path) -> Dictionary:
    """An unfilled dictionary of the shape cfg.json describes; what this loader cannot run refused."""
    where = directory / CFG_NAME
    architecture = cfg.get("architecture", "standard")
    if architecture not in ("topk", "standard", "transcoder"):
        raise DictionaryError(
            f"{where}: architecture {architecture!r}; this loads 'topk' and 'standard' autoencoders and 'transcoder's"
        )
    for key, default in (("normalize_activations", "none"), ("reshape_activations", "none")):
        if cfg.get(key, default) != default:
            raise DictionaryError(f"{where}: {key} {cfg[key]!r} is not supported (fold it into the weights first)")
    if cfg.get("rescale_acts_by_decoder_norm", False):
        raise DictionaryError(f"{where}: rescale_acts_by_decoder_norm is not supported (fold the decoder norms first)")
    metadata = cfg.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise DictionaryError(f"{where}: metadata is not an object")
    kind = "transcoder" if architecture == "transcoder" else "sae"
    site = metadata.get("hook_name")
    if not isinstance(site, str) or not site:
        raise DictionaryError(f"{where}: no metadata.hook_name (the site it reads, e.g. layers.3.resid_post)")
    try:
        site_layer(kind, site)
    except DictionaryError as exc:
        raise DictionaryError(f"{where}: metadata.hook_name: {exc}") from None
    d_sae = cfg.get("d_sae")
    if architecture == "topk" and "k" not in cfg:
        raise DictionaryError(f"{where}: a 'topk' dictionary without k")
    # a ReLU dictionary is TopK over all its features
    k = cfg.get("k", d_sae) if architecture != "standard" else d_sae
    ours = {key: value for key, value in metadata.items() if key not in ("hook_name", "hook_name_out", "kind")}
    try:
        d = Dictionary(
            kind,
            site,
            cfg.get("d_in"),
            d_sae,
            k,
            cfg.get("d_out") if kind == "transcoder" else None,
            apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", kind == "sae")),
            metadata=ours,
        )
    except DictionaryError as exc:
        raise DictionaryError(f"{where}: {exc}") from None
    return d


def _line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
