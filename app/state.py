"""Where the app keeps things.

* The model: opened once per process per (checkpoint, dtype) with ``st.cache_resource`` and shared
  by every browser session (the Tracer keeps concurrent sessions' hooks apart).
* Traces: a bounded LRU store, also process-wide, keyed by (checkpoint, dtype, prompt) or by an
  uploaded file's digest. Entries hold the Trace and, computed lazily once, its tables and bytes.
* A session remembers only small values: its widget choices and the key of the trace it shows,
  which says how to make it again should the store have evicted it.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import math
import os
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from model.checkpoint import INDEX, CheckpointError, SafetensorsSource
from model.config import ConfigError, ModelArgs
from tracing.errors import InputError
from tracing.interventions import Intervention
from tracing.loading import DEMO, Loaded, open_checkpoint, parse_dtype, resolve_checkpoint
from tracing.runner import check_token_ids, trace_tokens
from tracing.sites import site_shapes
from tracing.tables import BUILDERS
from tracing.tokenizer import TokenizerError
from tracing.trace import Trace, TraceError

ENV_CHECKPOINT = "ANATOMY_CHECKPOINT"  # the default checkpoint: 'demo' (assets/demo) or a directory
ENV_MAX_TOKENS = "ANATOMY_MAX_TOKENS"  # the longest prompt the app traces
ENV_DEVICE = "ANATOMY_DEVICE"  # cpu | cuda (default: cuda when available)
ENV_THREADS = "ANATOMY_THREADS"  # torch CPU threads (default: 1 for small models, torch's default otherwise)
# os.pathsep-separated directories the "Checkpoint directory" field may name ('demo' names the bundled
# one); unset: any directory, as suits one person on their own machine
ENV_CHECKPOINT_ROOTS = "ANATOMY_CHECKPOINT_ROOTS"
ENV_MAX_UPLOAD_MB = "ANATOMY_MAX_UPLOAD_MB"  # the largest trace file the app reads (default: server.maxUploadSize)
# the one answer under ANATOMY_CHECKPOINT_ROOTS: it must not tell what exists on the server or what a file holds
NOT_ALLOWED = "not a loadable checkpoint under the allowed roots (the server log says why)"
SMALL_MODEL_BYTES = 512 * 2**20  # below this, one CPU thread is fastest: the products are tiny
MAX_TOKENS = 512
# longer than the demo's index_topk, so the sparse attention visibly prunes (90 tokens on the demo)
DEFAULT_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is "
    "so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters."
)
# recorded besides tracing.sites.DEFAULT_PATTERNS: the cards' plots use them when present
EXTRA_SITES = (
    "layers.*.logit_lens.*",
    "layers.*.attn.indexer.head_weights",
    "layers.*.ffn.routed_out",
    "layers.*.ffn.shared_out",
)
PER_HEAD_PROBS = "layers.*.attn.probs"
PER_HEAD_PROBS_BUDGET = 64 * 2**20  # bytes of per-head attention probabilities worth keeping
BAD_INPUT = (CheckpointError, ConfigError, InputError, TraceError, TokenizerError)
DTYPES = ("bfloat16", "float32")
log = logging.getLogger(__name__)


# --- settings ------------------------------------------------------------------------------------------
def default_checkpoint() -> str:
    return os.environ.get(ENV_CHECKPOINT, "").strip() or "demo"


def checkpoint_roots() -> list[Path] | None:
    """The directories checkpoints may come from, symlinks resolved, or None: no restriction. The
    bundled demo and the operator's default checkpoint are always among them."""
    raw = os.environ.get(ENV_CHECKPOINT_ROOTS, "")
    if not raw.strip():
        return None
    named = [part.strip() for part in raw.split(os.pathsep) if part.strip()]
    roots = []
    for value in (*named, "demo", default_checkpoint()):
        root = resolve_checkpoint(value)
        roots += [Path(os.path.abspath(root)), root.resolve()]
    return list(dict.fromkeys(roots))


def max_upload_bytes() -> int:
    """The largest trace file the app reads: ANATOMY_MAX_UPLOAD_MB, or the server's own limit."""
    server = float(st.get_option("server.maxUploadSize"))  # megabytes, as Streamlit counts them: MiB
    try:
        megabytes = float(os.environ.get(ENV_MAX_UPLOAD_MB, "").strip() or server)
    except ValueError:
        megabytes = server
    if not math.isfinite(megabytes) or megabytes <= 0:
        megabytes = server
    return int(megabytes * 2**20)


def max_tokens() -> int:
    try:
        return max(1, int(os.environ.get(ENV_MAX_TOKENS, MAX_TOKENS)))
    except ValueError:
        return MAX_TOKENS


def device() -> str:
    import torch

    wanted = os.environ.get(ENV_DEVICE, "").strip()
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


def _available_memory() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# --- the model --------------------------------------------------------------------------------------------
@dataclass
class OpenModel:
    """A loaded checkpoint and what the app says about it."""

    loaded: Loaded
    path: Path
    dtype: str
    label: str
    notes: list[str] = field(default_factory=list)

    @property
    def args(self) -> ModelArgs:
        return self.loaded.model.args

    @property
    def source_id(self) -> tuple[str, str]:
        return (str(self.path), self.dtype)


def check_checkpoint(value: str) -> Path:
    """The directory ``value`` names, if it can be a checkpoint at all (cheap checks, every rerun)."""
    value = value.strip()
    if not value:
        raise CheckpointError("enter the path of a checkpoint directory")
    if value == "demo" and not (DEMO / "config.json").is_file():
        raise CheckpointError(
            "the bundled demo checkpoint is not in assets/demo yet (scripts/train_demo.py makes it): "
            "choose a checkpoint directory or upload a trace file"
        )
    roots = checkpoint_roots()
    if roots is not None:
        return _check_allowed(value, roots)
    path = resolve_checkpoint(value)
    if not path.exists():
        raise CheckpointError(f"{path}: no such directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: is a file, not a checkpoint directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(
            f"{path}: no config.json here; a checkpoint directory holds config.json, "
            "model.safetensors.index.json with its shards (or one model.safetensors), and tokenizer.json"
        )
    return path


def _check_allowed(value: str, roots: list[Path]) -> Path:
    """The real directory ``value`` names when it lies under one of ``roots`` and holds a config.json.
    A path outside them is refused before anything there is looked at beyond resolving its symlinks,
    and every refusal reads the same, so the field cannot be used to explore the server."""
    path = resolve_checkpoint(value)
    lexical = Path(os.path.abspath(path))  # '..' folded without touching the disk
    if not any(lexical.is_relative_to(root) for root in roots):
        log.warning("checkpoint %r refused: outside %s", value, ENV_CHECKPOINT_ROOTS)
        raise CheckpointError(NOT_ALLOWED)
    try:
        real = path.resolve(strict=True)  # a symlink loop, a NUL byte, no permission: refused alike
        if not any(real.is_relative_to(root) for root in roots):
            log.warning("checkpoint %r refused: it resolves to %s, outside %s", value, real, ENV_CHECKPOINT_ROOTS)
            raise CheckpointError(NOT_ALLOWED)
        if not (real / "config.json").is_file():
            log.warning("checkpoint %r refused: %s holds no config.json", value, real)
            raise CheckpointError(NOT_ALLOWED)
    except (OSError, RuntimeError, ValueError) as exc:
        if not isinstance(exc, CheckpointError):
            log.warning("checkpoint %r refused: %s", value, exc)
        raise CheckpointError(NOT_ALLOWED) from None
    return real


def _check_size(source: SafetensorsSource) -> int:
    """The weights' bytes; CheckpointError when they cannot fit in this machine's free memory."""
    size = sum(spec.dtype.itemsize * _numel(spec.shape) for spec in source.specs().values())
    free = _available_memory()
    if free is not None and size > 0.8 * free:
        path = source.directory
        raise CheckpointError(
            f"{path}: its weights take {size / 2**30:.1f} GiB, more than this machine's free memory "
            f"({free / 2**30:.1f} GiB). Trace it from the command line (python -m tracing run --checkpoint "
            f"{path} --stream --prompt ... --out trace.safetensors) and open the trace file here."
        )
    return size


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _set_threads(weight_bytes: int) -> None:
    """Threads for torch on the CPU. A small model's products take microseconds, and more threads only
    add synchronisation: on a busy 2-core machine a demo trace takes ~0.2 s on one thread and seconds
    on two. ANATOMY_THREADS overrides."""
    import torch

    wanted = os.environ.get(ENV_THREADS, "").strip()
    if wanted.isdigit() and int(wanted) > 0:
        torch.set_num_threads(int(wanted))
    elif weight_bytes < SMALL_MODEL_BYTES:
        torch.set_num_threads(1)


@st.cache_resource(max_entries=2, show_spinner="Loading the checkpoint…")
def _open_model(path: str, dtype: str, device_name: str) -> OpenModel:
    source = SafetensorsSource(path)  # config.json and the index; raises CheckpointError on either
    _set_threads(_check_size(source))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = open_checkpoint(path, device_name, parse_dtype(dtype))
    notes = [str(w.message) for w in caught]
    if loaded.tokenizer is None:
        notes.append("this checkpoint has no tokenizer.json: type token ids (like 0, 17, 42) instead of text")
    label = "bundled demo" if Path(path) == DEMO else Path(path).name
    return OpenModel(loaded, Path(path), dtype, label, notes)


@st.cache_resource
def _failures() -> dict[tuple, str]:
    """Why a checkpoint did not load, by (path, dtype, file times): not read again on every rerun."""
    return {}


def _stamp(path: Path) -> tuple:
    """Modification times that change when the checkpoint is fixed: files added or removed, the
    config or the index rewritten."""
    return tuple((path / name).stat().st_mtime_ns if (path / name).exists() else 0 for name in (".", "config.json", INDEX))


def open_model(value: str, dtype: str) -> OpenModel:
    """The model of checkpoint ``value`` ('demo' or a directory), loaded once per process;
    CheckpointError (or ConfigError, TokenizerError) says why not. Under ANATOMY_CHECKPOINT_ROOTS the
    reason goes to the server log and the user sees NOT_ALLOWED: a reason can quote the files."""
    if checkpoint_roots() is None:
        return _open_checked(value, dtype)
    try:
        return _open_checked(value, dtype)
    except (*BAD_INPUT, OSError, RuntimeError, ValueError) as exc:
        if str(exc) != NOT_ALLOWED:
            log.warning("checkpoint %r not loaded: %s", value, exc)
        raise CheckpointError(NOT_ALLOWED) from None


def _open_checked(value: str, dtype: str) -> OpenModel:
    path = check_checkpoint(value).resolve()
    key = (str(path), dtype, _stamp(path))
    failures = _failures()
    if key in failures:
        raise CheckpointError(failures[key])
    try:
        return _open_model(str(path), dtype, device())
    except BAD_INPUT as exc:
        failures[key] = str(exc)
        raise
    except (OSError, RuntimeError, ValueError) as exc:
        failures[key] = f"{path}: could not be loaded ({exc})"
        raise CheckpointError(failures[key]) from None


# --- the trace store -----------------------------------------------------------------------------------
class Entry:
    """One trace and what is derived from it, each computed at most once (thread-safe)."""

    def __init__(self, key: Hashable, trace: Trace, origin: str, seconds: float = 0.0):
        self.key = key
        self.trace = trace
        self.origin = origin  # where it came from, for people: "bundled demo · bfloat16", "trace file x.safetensors"
        self.seconds = seconds  # tracing (or reading) time
        self.nbytes = sum(t.numel() * t.element_size() for t in trace.tensors.values())
        self._lock = threading.RLock()
        self._memo: dict[Hashable, Any] = {}

    @property
    def traced(self) -> bool:
        """Traced here from a model (else read from a trace file)."""
        return self.key[0] == "model"

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        with self._lock:
            if key not in self._memo:
                self._memo[key] = compute()
            return self._memo[key]

    def tables(self) -> dict[str, pd.DataFrame]:
        """Every non-empty table (tracing.tables), each built once."""
        out = {name: self.table(name) for name in BUILDERS}
        return {name: frame for name, frame in out.items() if not frame.empty}

    def table(self, name: str) -> pd.DataFrame:
        return self.memo(("table", name), lambda: BUILDERS[name](self.trace))

    def trace_bytes(self) -> bytes:
        return self.memo("bytes", self.trace.to_bytes)


class TraceStore:
    """A least-recently-used map of entries, bounded in count and in tensor bytes."""

    def __init__(self, max_entries: int = 16, max_bytes: int = 2 * 2**30):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Entry | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, entry: Entry) -> Entry:
        with self._lock:
            self._entries[entry.key] = entry
            self._entries.move_to_end(entry.key)
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_entries or sum(e.nbytes for e in self._entries.values()) > self.max_bytes
            ):
                self._entries.popitem(last=False)
            return entry

    def __len__(self) -> int:
        return len(self._entries)


@st.cache_resource
def store() -> TraceStore:
    return TraceStore()


def record_patterns(args: ModelArgs, n_tokens: int) -> list[str]:
    names = list(site_shapes(args))
    wanted = ["default", *EXTRA_SITES]
    if n_tokens * n_tokens * args.n_heads * args.n_layers * 4 <= PER_HEAD_PROBS_BUDGET:
        wanted.append(PER_HEAD_PROBS)
    return [p for p in wanted if p == "default" or any(fnmatch.fnmatchcase(n, p) for n in names)]


def encode(om: OpenModel, prompt: str) -> list[int]:
    """Token ids of the prompt, or InputError saying what is wrong with it."""
    if not prompt.strip():
        raise InputError("The prompt is empty: type some text, then press Trace.")
    tokenizer = om.loaded.tokenizer
    if tokenizer is None:
        try:
            ids = [int(part) for part in prompt.replace(",", " ").split()]
        except ValueError:
            raise InputError("This checkpoint has no tokenizer.json: type token ids, like 0, 17, 42.") from None
    else:
        ids = tokenizer.encode(prompt)
    limit = min(max_tokens(), om.args.max_seq_len)
    if len(ids) > limit:
        raise InputError(
            f"The prompt is too long: {len(ids)} tokens, and the app traces at most {limit} "
            f"(model context {om.args.max_seq_len}, app limit {max_tokens()} set by {ENV_MAX_TOKENS}). Shorten it."
        )
    check_token_ids(ids, om.loaded.model, limit)
    return ids


def model_key(om: OpenModel, prompt: str, variant: Hashable = None) -> tuple:
    key = ("model", str(om.path), om.dtype, prompt)
    return key if variant is None else (*key, variant)


def trace_prompt(
    om: OpenModel,
    prompt: str,
    on_block: Callable[[int], None] | None = None,
    patches: dict | None = None,
    variant: Hashable = None,
    interventions: Sequence[Intervention] = (),
) -> Entry:
    """The trace of ``prompt`` on this model, from the store or traced now.

    ``patches`` (site name -> tensor, as ``tracing.runner.trace_tokens`` takes them) change the run;
    ``variant`` names them in the store's key (a run with patches needs one), e.g. a digest of the
    intervention, so a baseline and its intervened twin are cached side by side. ``interventions``
    (tracing.interventions: ablations, no correction bias, another index_topk) are named in the key
    by :func:`describe_interventions` on their own. InputError says what is wrong with either.
    """
    if patches and variant is None:
        raise ValueError("a patched trace needs a variant to tell it from the baseline in the store")
    interventions = tuple(interventions)
    named = [str(variant)] if variant is not None else []  # for people: the entry's origin
    if interventions:
        described = describe_interventions(interventions)
        variant = described if variant is None else (variant, described)
        named.append("; ".join(described))
    key = model_key(om, prompt, variant)
    entry = store().get(key)
    if entry is not None:
        return entry
    ids = encode(om, prompt)
    tokenizer = om.loaded.tokenizer
    started = time.perf_counter()
    trace = trace_tokens(
        om.loaded.model,
        ids,
        prompt=prompt,
        record=record_patterns(om.args, len(ids)),
        patches=patches,
        interventions=interventions,
        on_block=on_block,
        extra={"checkpoint": om.loaded.label},
        max_tokens=len(ids),
        token_strings=tokenizer.token_strings if tokenizer is not None else None,
    )
    origin = " · ".join([om.label, om.dtype, *named])
    return store().put(Entry(key, trace, origin, time.perf_counter() - started))


def describe_interventions(interventions: Sequence[Intervention]) -> tuple[str, ...]:
    """What each intervention does, as the trace's metadata says it: the store's key tells runs apart by these."""
    return tuple(intervention.describe() for intervention in interventions)


def session_model() -> OpenModel | None:
    """The model this session's sidebar names (loaded once per process), or None: a trace file is
    the source, or the checkpoint does not load (the sidebar shows why). For pages that trace."""
    source = st.session_state.get("source", "demo")
    if source == "upload":
        return None
    value = default_checkpoint() if source == "demo" else st.session_state.get("ckpt_dir", "")
    try:
        return open_model(value, st.session_state.get("dtype", "bfloat16"))
    except BAD_INPUT:
        return None


def open_upload(data: bytes, name: str) -> Entry:
    """A trace file's bytes, validated (TraceError says why not); no model is needed."""
    limit = max_upload_bytes()
    if len(data) > limit:  # the store is shared: one large file would push out everyone's traces
        raise TraceError(
            f"{name}: {len(data) / 2**20:.3g} MiB, more than the {limit / 2**20:.3g} MiB this app reads "
            f"({ENV_MAX_UPLOAD_MB}). Record fewer sites or a shorter prompt (python -m tracing run --record ...)."
        )
    key = ("upload", hashlib.sha256(data).hexdigest())
    entry = store().get(key)
    if entry is not None:
        return entry
    started = time.perf_counter()
    try:
        trace = Trace.from_bytes(data, name)
    except TraceError:
        raise
    except Exception as exc:  # anything else a hostile file provokes is still a bad file, not a crash
        raise TraceError(f"{name}: not a readable trace file ({type(exc).__name__}: {exc})") from None
    return store().put(Entry(key, trace, f"trace file {name}", time.perf_counter() - started))


# --- the session ---------------------------------------------------------------------------------------
SOURCES = ("demo", "dir", "upload")
_DEFAULTS: dict[str, Any] = {
    "source": "demo",
    "ckpt_dir": "",
    "prompt": DEFAULT_PROMPT,
    "dtype": "bfloat16",
    "block": 0,
    # the key of the trace this session shows: ("model", path, dtype, prompt) or ("upload", digest),
    # enough to trace it again should the store have evicted it
    "trace_key": None,
}
# widget values Streamlit would forget while their widget is not drawn (another page, another source)
_KEEP = ("ckpt_dir", "prompt", "dtype", "block", "anatomy_component", "query", "attention_head", "router_biased")


def init() -> None:
    """Each session key set once; widget values carried across pages."""
    for key, value in _DEFAULTS.items():
        if key not in st.session_state:
            st.session_state[key] = value
    for key in _KEEP:
        if key in st.session_state:
            st.session_state[key] = st.session_state[key]


@dataclass
class View:
    """What a page draws: one trace and the chosen block."""

    entry: Entry
    block: int

    @property
    def trace(self) -> Trace:
        return self.entry.trace

    @property
    def config(self) -> ModelArgs:
        return self.entry.trace.config

    @property
    def n_tokens(self) -> int:
        return self.entry.trace.n_tokens

    def tables(self) -> dict[str, pd.DataFrame]:
        return self.entry.tables()

    def table(self, name: str) -> pd.DataFrame:
        return self.entry.table(name)

    def memo(self, key: Hashable, compute: Callable[[], Any]) -> Any:
        return self.entry.memo(key, compute)


def current_entry() -> Entry | None:
    key = st.session_state.get("trace_key")
    return store().get(key) if key is not None else None


def current() -> View | None:
    entry = current_entry()
    if entry is None:
        return None
    block = int(st.session_state.get("block", 0) or 0)
    return View(entry, min(max(block, 0), entry.trace.config.n_layers - 1))
