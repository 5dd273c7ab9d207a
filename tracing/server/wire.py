"""What travels between a client and the model server: no pickle anywhere.

A request is a :class:`~tracing.runner.TraceRequest` in its JSON form, sent as ``application/json``;
one with patches, or with a graph holding constant tensors, is a safetensors file
(``application/x-safetensors``) whose tensors are the patches (by site name) and the graph's
constants (``graph/<name>``), and whose metadata holds the request's JSON under ``request``. The answer streams
(``application/x-ndjson``): one JSON object a line while the request waits and runs (``queued``:
its place; ``progress``: block i of n, step j of N; ``heartbeat``: the seconds since it came, when
nothing else was sent for :data:`HEARTBEAT` seconds), then ``{"trace": N}`` followed by the trace
file's N bytes, or ``{"error": "...", "status": 4xx or 5xx}``. A request refused before it is
queued gets a plain JSON answer ``{"error": "..."}`` with its 4xx status.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from ..analyses.graph import WIRE
from ..errors import InputError
from ..runner import TraceRequest

JSON = "application/json"
SAFETENSORS = "application/x-safetensors"
EVENTS = "application/x-ndjson"
REQUEST_KEY = "request"  # the safetensors metadata key of the request's JSON
HEARTBEAT = 2.0  # seconds: the longest an answer's stream stays silent while its request waits or runs


class TooLarge(InputError):
    """A body or patches over the server's limit (413)."""


@dataclass(frozen=True)
class Limits:
    """What one request may cost, checked before it is queued (and its time while it runs)."""

    max_body_bytes: int = 64 * 2**20
    max_patch_bytes: int = 64 * 2**20
    max_prompt_tokens: int = 4096
    max_generate: int = 512
    max_seconds: float = 600.0
    max_queue: int = 8
    # site patterns: each is matched against every site name (thousands for the 671B), before queueing
    max_record_patterns: int = 64
    max_pattern_chars: int = 200
    max_patches: int = 4096  # tensors in one request's patches
    # a backward pass (gradient_of) keeps every block's attention probabilities, T x T per head
    max_gradient_tokens: int = 1024

    @property
    def max_prompt_chars(self) -> int:
        """The longest prompt text the tokenizer is given (about 3 s of it per MB): far more characters
        than max_prompt_tokens of any text hold."""
        return 16 * self.max_prompt_tokens

    def describe(self) -> dict:
        return {
            "max_body_mb": self.max_body_bytes / 2**20,
            "max_patch_mb": self.max_patch_bytes / 2**20,
            "max_prompt_tokens": self.max_prompt_tokens,
            "max_generate": self.max_generate,
            "max_seconds": self.max_seconds,
            "max_queue": self.max_queue,
            "max_record_patterns": self.max_record_patterns,
            "max_pattern_chars": self.max_pattern_chars,
            "max_patches": self.max_patches,
            "max_gradient_tokens": self.max_gradient_tokens,
        }


def encode_request(request: TraceRequest) -> tuple[bytes, str]:
    """The body and content type of a request."""
    constants = request.graph.tensors if request.graph is not None else {}
    if not request.patches and not constants:
        return request.to_json().encode(), JSON
    tensors = {name: value.detach().cpu().contiguous() for name, value in (request.patches or {}).items()}
    tensors.update((WIRE + name, value.contiguous()) for name, value in constants.items())
    return save_safetensors(tensors, metadata={REQUEST_KEY: request.to_json()}), SAFETENSORS


def decode_request(body: bytes, content_type: str, limits: Limits) -> TraceRequest:
    """A request from its body; InputError (a 4xx) for anything malformed or over a limit."""
    kind = content_type.split(";")[0].strip().lower()
    if kind == JSON:
        return TraceRequest.from_json(body)
    if kind != SAFETENSORS:
        raise InputError(f"send the request as {JSON}, or as {SAFETENSORS} with patches, not {kind or 'no type'}")
    unreadable = (SafetensorError, ValueError, RuntimeError, OSError, RecursionError)
    try:
        header = _header(body)
    except unreadable as exc:
        raise InputError(f"the patches are not a readable safetensors file ({exc})") from None
    n_patches = len(header) - ("__metadata__" in header)
    if n_patches > limits.max_patches:  # counted before a tensor is made: the cost that grows with them
        raise TooLarge(f"the body holds {n_patches:,} patches; this server takes at most {limits.max_patches:,}")
    try:
        tensors = load_safetensors(body)
    except unreadable as exc:
        raise InputError(f"the patches are not a readable safetensors file ({exc})") from None
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise InputError("the patches are not a readable safetensors file (__metadata__ is not an object)")
    if REQUEST_KEY not in metadata:
        raise InputError(f"the safetensors body holds no {REQUEST_KEY!r} metadata (the request's JSON)")
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    if size > limits.max_patch_bytes:
        raise TooLarge(
            f"the patches hold {size / 2**20:.3g} MiB, more than this server takes ({limits.max_patch_bytes / 2**20:.3g})"
        )
    constants = {name.removeprefix(WIRE): t for name, t in tensors.items() if name.startswith(WIRE)}
    patches = {name: t for name, t in tensors.items() if not name.startswith(WIRE)}
    return TraceRequest.from_json(metadata[REQUEST_KEY], patches=patches or None, graph_tensors=constants or None)


def _header(body: bytes) -> dict:
    """The JSON header of a safetensors file in memory: each tensor's entry, and ``__metadata__``."""
    n = int.from_bytes(body[:8], "little")
    header = json.loads(body[8 : 8 + n])
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    return header


def event(**fields) -> bytes:
    """One line of the answer's stream."""
    return json.dumps(fields, allow_nan=False).encode() + b"\n"
