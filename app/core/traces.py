"""Traces: a bounded LRU store, process-wide like the models, of traces made from a prompt or read
from an uploaded file. An entry holds the Trace and, computed lazily once, its tables, bytes and
figures. Each is found by a TraceKey, which also says how to make it again should the store have
dropped it."""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pandas as pd
import streamlit as st

from model.config import ModelArgs
from tracing.analyses.attribution import AttributionRequest
from tracing.analyses.graph import Graph
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import Intervention
from tracing.errors import InputError
from tracing.runner import TraceRequest, check_token_ids
from tracing.sampling import Sampling
from tracing.sites import site_shapes
from tracing.tables import BUILDERS
from tracing.trace import Trace, TraceError

from . import settings
from .models import AppModel

# recorded besides tracing.sites.DEFAULT_PATTERNS: the cards' plots use them when present
EXTRA_SITES = (
    "layers.*.logit_lens.*",
    "layers.*.attn.indexer.head_weights",
    "layers.*.ffn.routed_out",
    "layers.*.ffn.shared_out",
)
PER_HEAD_PROBS = "layers.*.attn.probs"
PER_HEAD_PROBS_BUDGET = 64 * 2**20  # bytes of per-head attention probabilities worth keeping


@dataclass(frozen=True)
class Generation:
    """New tokens written after the prompt and how each is chosen. The seed of a sampled generation is
    drawn before the key is made, so the key says how to make the same tokens again."""

    tokens: int
    sampling: Sampling = Sampling()

    @classmethod
    def of(cls, tokens: int, sampling: Sampling | None = None) -> Generation | None:
        """None for no new tokens (a plain trace of the prompt); greedy settings in one form."""
        if tokens <= 0:
            return None
        sampling = sampling or Sampling()
        return cls(tokens, Sampling() if sampling.greedy else sampling.seeded())

    @staticmethod
    def answers(shown: Generation | None, tokens: int, sampling: Sampling) -> bool:
        """Whether a trace written with ``shown`` is what these settings ask for. A sampled request
        without a seed takes any seed: each Trace draws a new one."""
        if shown is None or tokens <= 0:
            return shown is None and tokens <= 0
        if shown.tokens != tokens or shown.sampling.greedy != sampling.greedy:
            return False
        s = shown.sampling
        return sampling.greedy or (
            (s.temperature, s.top_p) == (sampling.temperature, sampling.top_p) and sampling.seed in (None, s.seed)
        )


@dataclass(frozen=True)
class Chat:
    """The prompt as a user turn of DeepSeek-V3.2's conversation format (tracing.chat), so the model
    answers it; in thinking mode the answer starts with its reasoning."""

    thinking: bool = False

    def describe(self) -> str:
        return "chat turn, thinking" if self.thinking else "chat turn"


@dataclass(frozen=True)
class TraceKey:
    """Which trace: a prompt traced on a checkpoint (maybe with changes to the run), or a trace file."""

    source: str  # "model": traced here; "upload": read from a file
    checkpoint: str = ""  # model: the checkpoint directory
    dtype: str = ""  # model: the activation dtype
    prompt: str = ""  # model
    variant: Hashable = None  # model: what changed the run (patches, interventions); None: a plain trace
    sha256: str = ""  # upload: the file's digest
    generation: Generation | None = None  # model: the tokens written after the prompt; None: the prompt alone
    chat: Chat | None = None  # model: the prompt framed as a chat turn; None: the text as typed

    @classmethod
    def for_prompt(
        cls,
        om: AppModel,
        prompt: str,
        variant: Hashable = None,
        generation: Generation | None = None,
        chat: Chat | None = None,
    ) -> TraceKey:
        return cls("model", om.key, om.dtype, prompt, variant, generation=generation, chat=chat)

    @classmethod
    def for_upload(cls, data: bytes) -> TraceKey:
        return cls("upload", sha256=hashlib.sha256(data).hexdigest())

    @property
    def traced(self) -> bool:
        return self.source == "model"

    @property
    def plain(self) -> TraceKey:
        """The same prompt on the same model, run unchanged (writing the same number of tokens the same way)."""
        return replace(self, variant=None)

    def on(self, om: AppModel) -> bool:
        """Traced on this checkpoint in this dtype."""
        return self.traced and self.checkpoint == om.key and self.dtype == om.dtype

    def fingerprint(self) -> str:
        """Eight hex digits that tell this trace's downloads from another's."""
        values = ("upload", self.sha256) if not self.traced else ("model", self.checkpoint, self.dtype, self.prompt)
        if self.variant is not None:
            values = (*values, self.variant)
        if self.generation is not None:
            values = (*values, self.generation)
        if self.chat is not None:
            values = (*values, self.chat)
        return hashlib.sha256(repr(values).encode()).hexdigest()[:8]


class Entry:
    """One trace and what is derived from it, each computed at most once (thread-safe)."""

    def __init__(self, key: TraceKey, trace: Trace, origin: str, seconds: float = 0.0):
        self.key = key
        self.trace = trace
        self.origin = origin  # where it came from, for people: "bundled demo · bfloat16", "trace file" (session.origin names it)
        self.seconds = seconds  # tracing (or reading) time
        self.nbytes = sum(t.numel() * t.element_size() for t in trace.tensors.values())
        self._lock = threading.RLock()
        self._memo: dict[Hashable, Any] = {}

    @property
    def traced(self) -> bool:
        """Traced here from a model (else read from a trace file)."""
        return self.key.traced

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
        self._entries: OrderedDict[TraceKey, Entry] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: TraceKey) -> Entry | None:
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


def token_limit(om: AppModel) -> int:
    """The most positions the app traces on this model, prompt and generated tokens together."""
    return min(settings.max_tokens(), om.max_tokens())


def chat_refusal(om: AppModel) -> str | None:
    """Why this checkpoint cannot frame a chat turn (its vocabulary lacks the markers), or None."""
    return om.chat_refusal()


def request_for(
    om: AppModel,
    prompt: str,
    generation: Generation | None = None,
    chat: Chat | None = None,
    interventions: Mapping[str, Any] | None = None,
    attribution: AttributionRequest | None = None,
    record: Sequence[str] | None = None,
    patches: dict | None = None,
    patch_positions: str | None = None,
    graph: Graph | None = None,
) -> TraceRequest:
    """The TraceRequest of what a page asks: the prompt as typed (token ids where the checkpoint has
    no tokenizer), the sidebar's generation and chat framing, a page's interventions (an
    intervention graph too), attribution and sites; InputError says what is wrong with the prompt,
    in the app's words."""
    if not prompt.strip():
        raise InputError("The prompt is empty: type some text, then press Trace.")
    if chat is not None and (refusal := om.chat_refusal()) is not None:
        raise InputError(
            f"A chat turn needs DeepSeek-V3.2's chat vocabulary, and {refusal}: turn Chat off to trace the text as typed."
        )
    token_ids = None
    if not om.has_tokenizer():
        try:
            token_ids = tuple(int(part) for part in prompt.replace(",", " ").split())
        except ValueError:
            raise InputError("This checkpoint has no tokenizer.json: type token ids, like 0, 17, 42.") from None
    sampling = generation.sampling if generation is not None else None
    return TraceRequest(
        prompt=None if token_ids is not None else prompt,
        token_ids=token_ids,
        chat=chat is not None,
        thinking=chat is not None and chat.thinking,
        record=tuple(record) if record is not None else ("default",),
        generate=generation.tokens if generation is not None else 0,
        temperature=None if sampling is None or sampling.greedy else sampling.temperature,
        top_p=None if sampling is None or sampling.greedy else sampling.top_p,
        seed=None if sampling is None or sampling.greedy else sampling.seed,
        attribute=attribution is not None,
        position=None if attribution is None else attribution.position,
        target=None if attribution is None else attribution.target,
        contrast=None if attribution is None else attribution.contrast,
        interventions=dict(interventions or {}),
        patches=patches,
        patch_positions=patch_positions,
        graph=graph,
    )


def token_of(om: AppModel, flag: str, value: int | str) -> int:
    """One token's id from its text (as the model's tokenizer reads it, on a server too) or its
    number: any token of the vocabulary, not only the top predictions."""
    if isinstance(value, int) or (value.strip().isascii() and value.strip().isdigit()):
        token = int(value)
        if not 0 <= token < om.args.vocab_size:
            raise InputError(f"{flag} {token}: token ids are 0..{om.args.vocab_size - 1}")
        return token

    def tokens(text: str) -> list[int]:  # the text's ids without the BOS the tokenizer adds
        ids = om.encode(TraceRequest(prompt=text))
        return ids[1:] if ids and ids[0] == om.args.bos_token_id else ids

    got = tokens(value)
    if len(got) != 1:
        spaced = not value.startswith(" ") and len(tokens(" " + value)) == 1
        hint = f"; {' ' + value!r} is one token" if spaced else ""
        raise InputError(f"{flag} {value!r} is {len(got)} tokens: give one token (or its id){hint}")
    return got[0]


def encode(om: AppModel, prompt: str, chat: Chat | None = None) -> list[int]:
    """Token ids of the prompt (as a chat turn when ``chat``), or InputError saying what is wrong with it."""
    return _encoded(om, request_for(om, prompt, chat=chat))


def _encoded(om: AppModel, request: TraceRequest) -> list[int]:
    limit = token_limit(om)
    ids = om.encode(request)
    if len(ids) > limit:
        raise InputError(
            f"The prompt is too long: {len(ids)} tokens, and the app traces at most {limit} "
            f"(model context {om.args.max_seq_len}, app limit {settings.max_tokens()} set by {settings.ENV_MAX_TOKENS}). "
            "Shorten it."
        )
    if len(ids) + request.generate > limit:
        raise InputError(
            f"The prompt's {len(ids)} tokens and {request.generate} new ones make {len(ids) + request.generate}, more than "
            f"the {limit} the app traces: generate at most {max(0, limit - len(ids))} tokens, or shorten the prompt."
        )
    check_token_ids(ids, om.args, limit, request.generate)  # ids in the vocabulary
    return ids


def trace_prompt(
    om: AppModel,
    prompt: str,
    on_block: Callable[[int], None] | None = None,
    patches: dict | None = None,
    variant: Hashable = None,
    interventions: Mapping[str, Any] | None = None,
    generation: Generation | None = None,
    attribution: AttributionRequest | None = None,
    record: Sequence[str] | None = None,
    chat: Chat | None = None,
    patch_positions: str | None = None,
    graph: Graph | None = None,
) -> Entry:
    """The trace of ``prompt`` on this model, from the store or traced now.

    ``patches`` (site name -> tensor; at ``patch_positions`` only, when given) change the run;
    ``variant`` names them in the store's key (a
    run with patches needs one), e.g. a digest of the intervention, so a baseline and its
    intervened twin are cached side by side. ``interventions`` (the spec
    tracing.analyses.intervention_specs.from_spec reads: ablations, no correction bias, another
    index_topk) are named in the key by :func:`describe_interventions` on their own.
    ``generation``: the tokens to write after the prompt, through the decode path, with the
    interventions applied at every step; named in the key too; ``chat`` frames the prompt as a chat
    turn, also named in the key; ``graph``, an intervention graph (tracing.analyses.graph), named in
    the key by its fingerprint. ``attribution`` and ``record`` (site patterns instead of the app's
    usual ones) add an analysis to the run; name them in ``variant``. InputError says what is wrong
    with any of them.
    """
    if patches and variant is None:
        raise ValueError("a patched trace needs a variant to tell it from the baseline in the store")
    named = [str(variant)] if variant is not None else []  # for people: the entry's origin
    if interventions:
        described = describe_interventions(from_spec(interventions))
        if described:
            variant = described if variant is None else (variant, described)
            named.append("; ".join(described))
    if graph is not None:
        variant = ("graph", graph.fingerprint()) if variant is None else (variant, ("graph", graph.fingerprint()))
        named.append(graph.describe())
    key = TraceKey.for_prompt(om, prompt, variant, generation, chat)
    entry = store().get(key)
    if entry is not None:
        return entry
    request = request_for(om, prompt, generation, chat, interventions, attribution, record, patches, patch_positions, graph)
    ids = _encoded(om, request)
    if record is None:
        request = dataclasses.replace(request, record=tuple(record_patterns(om.args, len(ids) + request.generate)))
    started = time.perf_counter()
    trace = om.trace(request, on_block, max_tokens=token_limit(om))
    if generation is not None:
        named.append(describe_generation(generation))
    if chat is not None:
        named.insert(0, chat.describe())
    origin = " · ".join([om.label, om.dtype, *named])
    return store().put(Entry(key, trace, origin, time.perf_counter() - started))


def describe_generation(generation: Generation) -> str:
    """For people: ``+8 greedy`` or ``+8 sampled T=0.8 top-p 0.95 seed 3``."""
    s = generation.sampling
    how = "greedy" if s.greedy else f"sampled T={s.temperature:g} top-p {s.top_p:g} seed {s.seed}"
    return f"+{generation.tokens} {how}"


def describe_interventions(interventions: Sequence[Intervention]) -> tuple[str, ...]:
    """What each intervention does, as the trace's metadata says it: the store's key tells runs apart by these."""
    return tuple(intervention.describe() for intervention in interventions)


def open_upload(data: bytes, name: str) -> Entry:
    """A trace file's bytes, validated (TraceError says why not); no model is needed."""
    limit = settings.max_upload_bytes()
    if len(data) > limit:  # the store is shared: one large file would push out everyone's traces
        raise TraceError(
            f"{name}: {len(data) / 2**20:.3g} MiB, more than the {limit / 2**20:.3g} MiB this app reads "
            f"({settings.ENV_MAX_UPLOAD_MB}). Record fewer sites or a shorter prompt (python -m tracing run --record ...)."
        )
    key = TraceKey.for_upload(data)
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
    return store().put(Entry(key, trace, "trace file", time.perf_counter() - started))  # the name is the session's
