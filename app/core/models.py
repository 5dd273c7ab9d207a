"""Models: what the app asks of a model (:class:`AppModel`: describe it, encode a request's prompt,
trace a request), and the models of this process (:class:`LocalModel`). Pages reach a model only
through AppModel, as llm-transparency-tool's pages reach theirs through ``TransparentLlm``, so a
model elsewhere (a model server) is one more implementation, not a change to any page.

Each checkpoint is opened once per process per (checkpoint, dtype) with ``st.cache_resource`` and
shared by every browser session (the Tracer keeps concurrent sessions' hooks apart). A checkpoint
that failed is not read again until its files change.

Under ANATOMY_CHECKPOINT_ROOTS the checkpoint field is confined by app.core.paths, as every path
field is: one refusal, whatever the reason.
"""

from __future__ import annotations

import logging
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import streamlit as st

from model import kernels
from model.checkpoint import INDEX, CheckpointError, SafetensorsSource
from model.config import ModelArgs
from model.stream import available_memory, model_bytes
from tracing.chat import encode_chat
from tracing.cli.loading import DEMO, Loaded, open_checkpoint, parse_dtype, resolve_checkpoint
from tracing.client import Client, read_token_file
from tracing.errors import InputError
from tracing.plan import weights_said
from tracing.runner import TraceRequest, encode, run
from tracing.tokenizer import TokenizerError
from tracing.trace import Trace

from . import paths, settings
from .errors import BAD_INPUT

CHECKPOINT = "a loadable checkpoint"  # what the checkpoint field opens, in its one refusal (app.core.paths)
NOT_ALLOWED = paths.refusal(CHECKPOINT)
log = logging.getLogger(__name__)


class AppModel(ABC):
    """A model as the app's pages see it, wherever it runs."""

    key: str  # what the trace store tells its traces apart by (a checkpoint directory)
    label: str  # for people: "bundled demo", a directory's name
    dtype: str  # the activation dtype, "bfloat16" or "float32"
    notes: list[str]  # what loading it said

    @property
    @abstractmethod
    def args(self) -> ModelArgs: ...

    def max_tokens(self) -> int:
        """The most tokens the model runs, prompt and generated together."""
        return self.args.max_seq_len

    @abstractmethod
    def describe(self) -> list[str]:
        """Lines for the sidebar: the architecture, where and how it computes."""

    @abstractmethod
    def has_tokenizer(self) -> bool: ...

    @abstractmethod
    def chat_refusal(self) -> str | None:
        """Why this model's vocabulary cannot frame a chat turn, or None."""

    @abstractmethod
    def encode(self, request: TraceRequest) -> list[int]:
        """The token ids ``request`` feeds (its prompt through the tokenizer, or its own)."""

    @abstractmethod
    def trace(self, request: TraceRequest, on_block: Callable[[int], None] | None, max_tokens: int) -> Trace:
        """``request`` run on this model (tracing.runner.run)."""


@dataclass
class RemoteModel(AppModel):
    """A model a server holds (``python -m tracing serve``, maybe over the ranks of a node): the
    pages see it as they see a local one; each trace is a request to the server."""

    client: Client
    facts: dict
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return self.client.url

    @property
    def label(self) -> str:
        return f"{self.facts['model']} on the server"

    @property
    def dtype(self) -> str:
        return self.facts["dtype"]

    @property
    def args(self) -> ModelArgs:
        return ModelArgs.from_json(self.facts["config"])

    def describe(self) -> list[str]:
        a, f = self.args, self.facts
        ranks = f"{f['ranks']} ranks" if f["ranks"] > 1 else "1 process"
        held = sofar = None
        try:
            health = self.client.health()
            load = f"queue {health['queue']}, {'busy' if health['running'] else 'idle'}"
            said = health.get("load")  # held or streamed, and its memory (tracing.plan)
            held = said.get("line") if isinstance(said, dict) else None
            streamed = health.get("streamed")  # every request's weights so far, from a server trusted for nothing
            keys = ("disk_bytes", "host_bytes", "device_hit_bytes")
            if isinstance(streamed, dict) and all(type(v := streamed.get(k)) is int and 0 <= v < 2**63 for k in keys):
                sofar = f"streamed so far: {weights_said({k: streamed[k] for k in keys})}"
        except InputError:
            load = "not answering now"
        return [
            f"{f['model']}: {a.n_layers} blocks, d = {a.dim}, {a.n_routed_experts} experts, vocabulary {a.vocab_size:,}",
            f"model server {self.client.url}: {ranks} on {f['device']}, {f['dtype']}; {load}",
            *([held[:300]] if isinstance(held, str) else []),
            *([sofar] if sofar else []),
        ]

    def max_tokens(self) -> int:
        return self.client.max_tokens()

    def has_tokenizer(self) -> bool:
        return bool(self.facts["tokenizer"])

    def chat_refusal(self) -> str | None:
        return self.facts["chat_refusal"]

    def encode(self, request: TraceRequest) -> list[int]:
        return self.client.encode(request.check())

    def trace(self, request: TraceRequest, on_block: Callable[[int], None] | None, max_tokens: int) -> Trace:
        last = self.args.n_layers - 1

        def progress(event: dict) -> None:  # raising here (the app's Stop) closes the connection: the server stops
            if on_block is not None and "progress" in event:  # blocks 1..n, as the server counts them
                on_block(min(max(event["progress"]["block"] - 1, 0), last))

        return self.client.trace(request, on_progress=progress)


@dataclass
class LocalModel(AppModel):
    """A checkpoint loaded in this process."""

    loaded: Loaded
    path: Path
    dtype: str
    label: str
    notes: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return str(self.path)

    @property
    def args(self) -> ModelArgs:
        return self.loaded.model.args

    def describe(self) -> list[str]:
        a = self.args
        lines = [f"{self.label}: {a.n_layers} blocks, d = {a.dim}, {a.n_routed_experts} experts, vocabulary {a.vocab_size:,}"]
        if self.loaded.device.type == "cpu":  # the route decides how fast (and how rounded) every bf16 product is here
            cpu = kernels.describe()
            lines += [f"CPU bfloat16 products: {cpu['cpu_products']}", f"CPU threads: {cpu['cpu_threads']}"]
        else:
            lines.append(f"device: {self.loaded.device}")
        return lines

    def has_tokenizer(self) -> bool:
        return self.loaded.tokenizer is not None

    def chat_refusal(self) -> str | None:
        if self.loaded.tokenizer is None:
            return "this checkpoint has no tokenizer.json"
        try:
            encode_chat(self.loaded.tokenizer, "")
        except TokenizerError as exc:
            return str(exc).partition(":")[0]  # "this tokenizer has no <｜User｜> token"
        return None

    def encode(self, request: TraceRequest) -> list[int]:
        return encode(request.check(), self.loaded.tokenizer)

    def trace(self, request: TraceRequest, on_block: Callable[[int], None] | None, max_tokens: int) -> Trace:
        with kernels.serial_passes(settings.threads()):  # this session's thread only (another traces beside it)
            return run(
                self.loaded.model,
                request,
                self.loaded.tokenizer,
                on_block=on_block,
                extra={"checkpoint": self.loaded.label if self.path == DEMO else self.path.name},  # not the server's path
                max_tokens=max_tokens,
            )


def check_checkpoint(value: str) -> Path:
    """The directory ``value`` names, if it can be a checkpoint at all (cheap checks, every rerun)."""
    value = value.strip()
    if not value:
        raise CheckpointError("enter the path of a checkpoint directory")
    if value == "demo" and not (DEMO / "config.json").is_file():
        raise CheckpointError(
            "the bundled demo checkpoint is missing from assets/demo (scripts/train_demo.py makes it): "
            "choose a checkpoint directory or upload a trace file"
        )
    path = resolve_checkpoint(value)
    if paths.confined():
        return paths.confine(path, CHECKPOINT, "config.json")
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


def _available_memory() -> int | None:
    try:
        return available_memory()
    except (ValueError, OSError, AttributeError):
        return None


def _check_size(source: SafetensorsSource) -> int:
    """The loaded model's bytes (model.stream.model_bytes); CheckpointError when they cannot fit in
    this machine's free memory."""
    size = model_bytes(source)
    free = _available_memory()
    if free is not None and size > 0.8 * free:
        path = source.directory
        raise CheckpointError(
            f"{path}: its weights take {size / 2**30:.1f} GiB, more than this machine's free memory "
            f"({free / 2**30:.1f} GiB). Trace it from the command line (python -m tracing run --checkpoint "
            f"{path} --stream --prompt ... --out trace.safetensors) and open the trace file here."
        )
    return size


@st.cache_resource(max_entries=2, show_spinner="Loading the checkpoint…")
def _open_model(path: str, dtype: str, device_name: str) -> LocalModel:
    source = SafetensorsSource(path)  # config.json and the index; raises CheckpointError on either
    _check_size(source)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = open_checkpoint(path, device_name, parse_dtype(dtype))
    notes = [str(w.message) for w in caught]
    if loaded.tokenizer is None:
        notes.append("this checkpoint has no tokenizer.json: type token ids (like 0, 17, 42) instead of text")
    label = "bundled demo" if Path(path) == DEMO else Path(path).name
    return LocalModel(loaded, Path(path), dtype, label, notes)


@st.cache_resource
def _failures() -> dict[tuple, str]:
    """Why a checkpoint did not load, by (path, dtype, file times): not read again on every rerun."""
    return {}


def _stamp(path: Path) -> tuple:
    """Modification times that change when the checkpoint is fixed: files added or removed, the
    config or the index rewritten."""
    return tuple((path / name).stat().st_mtime_ns if (path / name).exists() else 0 for name in (".", "config.json", INDEX))


def open_model(value: str, dtype: str) -> AppModel:
    """The model of checkpoint ``value`` ('demo' or a directory), loaded once per process;
    CheckpointError (or ConfigError, TokenizerError) says why not; under ANATOMY_CHECKPOINT_ROOTS the
    one refusal, NOT_ALLOWED, its reason in the server log (app.core.paths)."""
    with paths.refused_alike(CHECKPOINT, value, (*BAD_INPUT, OSError, RuntimeError, ValueError)):
        return _open_checked(value, dtype)


def _open_checked(value: str, dtype: str) -> AppModel:
    path = check_checkpoint(value).resolve()
    key = (str(path), dtype, _stamp(path))
    failures = _failures()
    if key in failures:
        raise CheckpointError(failures[key])
    try:
        return _open_model(str(path), dtype, settings.device())
    except BAD_INPUT as exc:
        failures[key] = str(exc)
        raise
    except (OSError, RuntimeError, ValueError) as exc:
        failures[key] = f"{path}: could not be loaded ({exc})"
        raise CheckpointError(failures[key]) from None


@st.cache_resource(max_entries=4, show_spinner="Connecting to the model server…")
def _open_server(url: str, token_file: str | None) -> RemoteModel:
    client = Client(url, read_token_file(token_file, settings.ENV_SERVER_TOKEN_FILE))  # timeouts, caps: tracing.client
    facts = client.info()
    notes = [f"the server takes prompts of up to {client.max_prompt_tokens():,} tokens"]
    return RemoteModel(client, facts, notes)


def open_server(url: str) -> AppModel:
    """The model of the server at ``url`` (its token from ANATOMY_SERVER_TOKEN_FILE); InputError
    says why not. A shared deployment (ANATOMY_CHECKPOINT_ROOTS) reaches only ANATOMY_SERVER: a URL
    typed by a visitor would make the app fetch from anywhere."""
    url = url.strip()
    if not url:
        raise InputError("enter the model server's URL (python -m tracing serve prints it)")
    if settings.checkpoint_roots() is not None and url.rstrip("/") != settings.server_url().rstrip("/"):
        log.warning("model server %r refused: not ANATOMY_SERVER", url)
        raise InputError("only the model server this deployment names (ANATOMY_SERVER) can be used here")
    return _open_server(url.rstrip("/"), settings.server_token_file())  # a server that fails is asked again next time


def open_by_key(key: str, dtype: str) -> AppModel:
    """The model a TraceKey names (a server's URL, or a checkpoint directory)."""
    return open_server(key) if key.startswith(("http://", "https://")) else open_model(key, dtype)
