"""Features in traces and interventions on them: a run's sparse dictionaries (tracing.dictionary.dictionary)
applied at the sites they read while the model runs.

A run names its dictionaries (``--dictionary DIR``, ``TraceRequest(dictionaries=...)``, a server's by
name); each reads one site, one dictionary per site. The Tracer records, per position, its strongest
features, their activations and the norm of its reconstruction error as the sites
``<site>.features.{top_ids,top_acts,error_norm}`` (tracing.sites' feature rows), from the value the
model goes on with (after patches and interventions). :class:`FeatureEdit` zeroes or scales a
feature, or adds its decoder direction, at chosen positions: the model's value plus the change of
that feature's part of the reconstruction, so the dictionary's error stays in the stream.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..analyses.interventions import Intervention, PassContext, Positions, Replace, describe_positions
from ..errors import InputError
from ..sites import DICTIONARY_SITES, FEATURES_TOPK, TRANSCODER_SITE, feature_site, hook_points, layer_site, site_name

if TYPE_CHECKING:
    from model.config import ModelArgs

    from .dictionary import Dictionary

FEATURE_SITES = ("top_ids", "top_acts", "error_norm")
MAX_DICTIONARIES = 8  # a run's dictionaries (each one more product per position and block it reads)


def read_site(site: str) -> tuple[int, str]:
    """(block, what it reads) of a dictionary's site: a stream site, or a block's FFN (a transcoder);
    InputError for any other."""
    where = layer_site(site)
    if where is None or where[1] not in (*DICTIONARY_SITES, TRANSCODER_SITE):
        readable = ", ".join(f"layers.N.{s}" for s in (*DICTIONARY_SITES, TRANSCODER_SITE))
        raise InputError(f"a dictionary of {site!r}: a dictionary reads one of {readable}")
    return where


def sites_of(dictionaries: Mapping[str, Dictionary]) -> list[str]:
    """The feature sites a run with these dictionaries (by site) records."""
    return [feature_site(site, what) for site in dictionaries for what in FEATURE_SITES]


def resolve(
    entries: Sequence[Any],
    args: ModelArgs,
    catalogue: Mapping[str, Dictionary] | None = None,
    device: torch.device | str | None = None,
) -> dict[str, Dictionary]:
    """A run's dictionaries by the site each reads, each checked against the model (its width, its
    block). ``entries``: Dictionary objects, or directories (tracing.dictionary.dictionary.load: sizes
    checked before reading); with ``catalogue`` (a server's, loaded from the directory it was started
    with) names of that catalogue only, never paths. InputError (DictionaryError) in one line."""
    from .dictionary import Dictionary, check_fits, load

    if len(entries) > MAX_DICTIONARIES:
        raise InputError(f"{len(entries)} dictionaries: a run takes at most {MAX_DICTIONARIES}")
    out: dict[str, Dictionary] = {}
    for entry in entries:
        if isinstance(entry, Dictionary):
            d = entry
        elif catalogue is not None:
            if not isinstance(entry, str) or entry not in catalogue:
                known = ", ".join(sorted(catalogue)) or "none (serve --dictionaries DIR)"
                raise InputError(f"dictionary {str(entry)[:60]!r}: not one of this server's ({known})")
            d = catalogue[entry]
        elif isinstance(entry, str | os.PathLike):
            d = load(entry)
        else:
            raise InputError(f"a dictionary is a directory or a Dictionary, not {type(entry).__name__}")
        read_site(d.site)
        check_fits(d, args)
        if d.site in out:
            raise InputError(f"two dictionaries read {d.site}: a run takes one per site")
        out[d.site] = d if device is None else d.to(device)
    return out


MAX_CATALOGUE = 64  # a server's dictionaries


def load_catalogue(directory: str | os.PathLike, args: ModelArgs) -> dict[str, Dictionary]:
    """A server's dictionaries (``serve --dictionaries DIR``) by name: DIR itself when it holds one,
    else each subdirectory that does, named by its directory; each checked against the model. A
    request names them, and no request reaches a path."""
    from pathlib import Path

    from .dictionary import CFG_NAME, DictionaryError, check_fits, load

    root = Path(directory)
    if not root.is_dir():
        raise DictionaryError(f"--dictionaries {root}: not a directory")
    found = [root] if (root / CFG_NAME).is_file() else sorted(p for p in root.iterdir() if (p / CFG_NAME).is_file())
    if not found:
        raise DictionaryError(f"--dictionaries {root}: holds no dictionary (a directory with {CFG_NAME})")
    if len(found) > MAX_CATALOGUE:
        raise DictionaryError(f"--dictionaries {root}: {len(found)} dictionaries; a server takes at most {MAX_CATALOGUE}")
    out = {}
    for path in found:
        d = load(path)
        read_site(d.site)
        check_fits(d, args)
        out[path.name] = d
    return out


def describe_catalogue(catalogue: Mapping[str, Dictionary]) -> dict[str, dict]:
    """What a server tells of its dictionaries (/info): what a client names and what each reads."""
    return {name: {"site": d.site, "kind": d.kind, "n_features": d.n_features, "k": d.k} for name, d in catalogue.items()}


def dictionary_info(dictionaries: Mapping[str, Dictionary], names: Sequence[str] = ()) -> dict[str, dict]:
    """What a trace records of its dictionaries (``extra["dictionaries"]``), by site: the tables and
    pages read it (the width of the ids, the name it was given)."""
    out = {}
    for i, (site, d) in enumerate(dictionaries.items()):
        name = str(names[i]) if i < len(names) and isinstance(names[i], str | os.PathLike) else site
        out[site] = {
            "name": os.path.basename(os.path.normpath(name)) or name,
            "kind": d.kind,
            "n_features": int(d.n_features),
            "k": int(d.k),
        }
    return out


@torch.no_grad()
def top_features(d: Dictionary, x: torch.Tensor, target: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A dictionary on rows of its input (..., d_in): the FEATURES_TOPK strongest features of each row
    (ids, -1 past the active ones; activations, 0 there) and the norm of the error of its
    reconstruction of ``target`` (its input, for a sparse autoencoder)."""
    x = x.to(d.W_enc.device, torch.float32)
    acts = d.encode(x)  # (..., n)
    top = acts.topk(min(FEATURES_TOPK, acts.shape[-1]), dim=-1)
    ids = top.indices.masked_fill(top.values <= 0, -1)
    values = top.values.clamp_min(0)
    missing = FEATURES_TOPK - ids.shape[-1]
    if missing > 0:  # a dictionary of fewer features than the sites hold
        ids = torch.cat([ids, ids.new_full((*ids.shape[:-1], missing), -1)], dim=-1)
        values = torch.cat([values, values.new_zeros((*values.shape[:-1], missing))], dim=-1)
    target = x if target is None else target.to(x.device, torch.float32)
    error = (target - d.decode(acts)).norm(dim=-1)  # (...)
    return {"top_ids": ids.cpu(), "top_acts": values.float().cpu(), "error_norm": error.float().cpu()}


class Features:
    """The feature sites of a run's dictionaries, recorded by hooks registered after the tracer's own
    (so they read the value the model goes on with); ``record`` takes {site: value (T, ...)}."""

    def __init__(self, model: torch.nn.Module, dictionaries: Mapping[str, Dictionary], hooks, record: Callable[[dict], None]):
        points = hook_points(model)
        self._inputs: dict[int, torch.Tensor] = {}  # block -> its FFN's input, this pass (transcoders)
        for site, d in dictionaries.items():
            block, reads = read_site(site)
            if reads == TRANSCODER_SITE:
                hooks.before(model.layers[block].ffn, self._keep_input(block))
                hooks.after(points[site_name(block, "ffn_out")], self._transcoder(site, block, d, record))
            else:
                hooks.after(points[site], self._sae(site, d, record))

    def _keep_input(self, block: int):
        def hook(module, args):
            self._inputs[block] = args[0]  # (B, T, D): what the FFN reads

        return hook

    @staticmethod
    def _named(site: str, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {feature_site(site, what): value[0] for what, value in values.items()}  # batch dropped

    def _sae(self, site: str, d: Dictionary, record):
        def hook(module, inputs, output):
            record(self._named(site, top_features(d, output)))

        return hook

    def _transcoder(self, site: str, block: int, d: Dictionary, record):
        def hook(module, inputs, output):
            record(self._named(site, top_features(d, self._inputs.pop(block), output)))

        return hook


@dataclass(frozen=True)
class FeatureEdit(Intervention):
    """One feature of a run's dictionary changed at ``positions`` (all: None): its activation times
    ``scale`` (0 zeroes it), plus ``add`` times its decoder direction. The value at the site the
    dictionary reconstructs becomes ``value + ((scale - 1) * act + add) * W_dec[feature]``: the
    error of the reconstruction stays. A transcoder's feature changes its block's FFN update
    (``ffn_out``), its activation read from the FFN's input. Bound to the run's dictionary and model
    (:func:`bind`) before it runs."""

    site: str
    feature: int
    scale: float = 1.0
    add: float = 0.0
    positions: Positions | None = None
    dictionary: Any = field(default=None, compare=False, repr=False)
    norm: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def replacements(self, args: ModelArgs) -> dict[str, Replace]:
        block, reads = read_site(self.site)
        d = self.dictionary
        if d is None:
            raise InputError(f"{self.describe()}: the run has no dictionary of {self.site} (--dictionary DIR)")
        if not 0 <= self.feature < d.n_features:
            raise InputError(f"{self.describe()}: the dictionary of {self.site} has features 0..{d.n_features - 1}")
        direction = d.W_dec[self.feature].detach().float()  # (D,)
        stash: dict[str, torch.Tensor] = {}  # a transcoder's input, this pass

        def change(value: torch.Tensor, ctx: PassContext, source: torch.Tensor) -> torch.Tensor | None:
            if (rows := ctx.rows(self.positions)) is None:
                return None
            acts = d.encode(source[:, rows].to(direction.device, torch.float32))[..., self.feature]  # (B, R)
            delta = ((self.scale - 1.0) * acts + self.add)[..., None] * direction  # (B, R, D)
            out = value.clone()
            out[:, rows] = (value[:, rows].float() + delta.to(value.device)).to(value.dtype)
            return out

        if reads != TRANSCODER_SITE:
            return {self.site: lambda value, ctx: change(value, ctx, value)}
        if self.norm is None:
            raise InputError(f"{self.describe()}: a transcoder's feature needs the model's FFN norm (bind)")

        def keep(value, ctx):  # the stream entering the FFN's norm: what the FFN reads, normalised
            stash["input"] = self.norm(block, value)
            return None

        def edit(value, ctx):
            return change(value, ctx, stash.pop("input"))

        return {site_name(block, "resid_mid"): keep, site_name(block, "ffn_out"): edit}

    def describe(self) -> str:
        how = "zero" if self.scale == 0 and not self.add else ""
        if not how:
            how = " ".join(part for part in (f"×{self.scale:g}" if self.scale != 1 else "", _added(self.add)) if part)
        return f"feature {self.site}:{self.feature} {how or 'unchanged'}{describe_positions(self.positions)}"


def _added(add: float) -> str:
    return "" if not add else f"{'+' if add > 0 else '-'}{abs(add):g}·direction"


def ffn_norm(model: torch.nn.Module) -> Callable[[int, torch.Tensor], torch.Tensor]:
    """``fn(block, stream)``: the FFN's input the block forms from its stream (its ffn_norm, as the
    block calls it), without the module's hooks."""

    def normed(block: int, stream: torch.Tensor) -> torch.Tensor:
        layer = model.layers[block]
        return type(layer.ffn_norm).forward(layer.ffn_norm, stream, layer.dtype)

    return normed


def bind(interventions: list[Intervention], dictionaries: Mapping[str, Dictionary], model=None) -> list[Intervention]:
    """The feature edits among ``interventions`` given the run's dictionary of their site (and the
    model's FFN norm, for a transcoder's); the others as they are."""
    out = []
    for i in interventions:
        if isinstance(i, FeatureEdit):
            norm = ffn_norm(model) if model is not None else None
            i = FeatureEdit(i.site, i.feature, i.scale, i.add, i.positions, dictionaries.get(i.site), norm)
        out.append(i)
    return out


_NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,3})?"
_EDIT = re.compile(rf"(\d{{1,9}})(?:=(0)|\*({_NUMBER})|([-+](?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{{1,3}})?))")
SYNTAX = "SITE:FEATURE=0, SITE:FEATURE*SCALE or SITE:FEATURE+AMOUNT, then [@P|@A:B]"


def parse_edits(text: str, parse_positions: Callable[[str, str], Positions]) -> list[FeatureEdit]:
    """``--feature``'s text: comma-separated ``SITE:FEATURE=0`` (zero it), ``SITE:FEATURE*SCALE``
    (scale its activation), ``SITE:FEATURE+AMOUNT`` (add AMOUNT times its decoder direction; ``-``
    subtracts), each optionally ``@P`` or ``@A:B``: e.g. ``layers.1.resid_post:17=0@5``."""
    out = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        body, at, where = item.partition("@")
        site, sep, edit = body.strip().partition(":")
        m = _EDIT.fullmatch(edit.strip())
        if not sep or m is None:
            raise InputError(f"--feature {item[:80]!r}: expected {SYNTAX}, e.g. layers.1.resid_post:17=0@5")
        read_site(site.strip())
        zero, scale, add = m.group(2), m.group(3), m.group(4)
        value = float(scale if scale is not None else add) if zero is None else 0.0
        if not math.isfinite(value):
            raise InputError(f"--feature {item[:80]!r}: the number must be finite")
        positions = parse_positions("--feature", where) if at else None
        if zero is not None or scale is not None:
            out.append(FeatureEdit(site.strip(), int(m.group(1)), scale=value, positions=positions))
        else:
            out.append(FeatureEdit(site.strip(), int(m.group(1)), add=value, positions=positions))
    if not out:
        raise InputError(f"--feature: no edit given (expected {SYNTAX})")
    return out
