"""A model server's client: ``Client(url, token).trace(...)`` returns a Trace, as tracing.run does
in this process (the server runs the same request: the same trace file's bytes).

    from tracing.client import Client
    client = Client("http://127.0.0.1:8600")
    trace = client.trace(prompt="It is a truth", generate=8, on_progress=print)
    client.health()   # {"model", "dtype", "device", "ranks", "queue", "running"}

The client trusts the server no more than a server trusts its clients: connecting has a timeout
(``timeout``, ANATOMY_SERVER_TIMEOUT, 5 s) and so has every line of an answer (``read_timeout``,
ANATOMY_SERVER_READ_TIMEOUT, 60 s: the server sends progress or a heartbeat every few seconds while
it works, so only a server that stalls or drips reaches it); an answer is read no further than its
cap (/health and /info 1 MiB, a line of the stream 64 KiB, a trace what the request can make on the
model /info describes and never more than ANATOMY_SERVER_MAX_TRACE_MB). Whatever goes wrong, a
refusal, a malformed or oversized answer, a timeout, a server gone, is one :class:`ServerError`
(an InputError: the command line's one line and status 2, the app's ``st.error``) with the
server's own message cut to MESSAGE_CHARS. Leaving ``trace`` early (an exception raised by
``on_progress``, Ctrl-C, the app's Stop) closes the connection, and the server ends the request at
its next block.
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx

from model.config import ConfigError, ModelArgs

from .bearer import check_token, read_token_file
from .errors import InputError
from .runner import TraceRequest
from .server.wire import encode_request
from .sites import estimate_bytes, select
from .trace import Trace, TraceError

__all__ = ["Client", "ServerError", "read_answer", "read_token_file"]

DEFAULT_URL = "http://127.0.0.1:8600"
ENV_SERVER = "ANATOMY_SERVER"  # the server's URL, for the app and run --server
ENV_TOKEN_FILE = "ANATOMY_SERVER_TOKEN_FILE"
ENV_TIMEOUT = "ANATOMY_SERVER_TIMEOUT"  # seconds to connect (and to send)
ENV_READ_TIMEOUT = "ANATOMY_SERVER_READ_TIMEOUT"  # seconds for each line of an answer
ENV_MAX_TRACE_MB = "ANATOMY_SERVER_MAX_TRACE_MB"  # the largest trace a client takes, whatever the server says

TIMEOUT = 5.0
READ_TIMEOUT = 60.0
MAX_TRACE_BYTES = 16 * 2**30
MAX_JSON_BYTES = 2**20  # /health, /info: a few KB
MAX_IDS_BYTES = 64 * 2**20  # /encode: a prompt's ids, a few bytes each
MAX_LINE_BYTES = 64 * 2**10  # one line of a trace's answer (an event, an error), and a refusal's body
STEADY_BYTES = 2**20  # a trace arriving slower than this per read timeout is a stalled one
TRACE_SLACK = 64 * 2**20  # the trace file's metadata (config, token strings, vocabulary, tables) beside its tensors
TRACE_SLACK_PER_TOKEN = 4096
MESSAGE_CHARS = 300  # of a server's message, shown


class ServerError(InputError):
    """What a model server answered that cannot be used, or that it did not answer: its refusal, a
    malformed or oversized answer, a timeout, a connection lost. One line."""


class Client:
    def __init__(
        self,
        url: str | None = None,
        token: str | None = None,
        timeout: float | None = None,
        read_timeout: float | None = None,
        max_trace_bytes: int | None = None,
    ):
        self.url = (url or os.environ.get(ENV_SERVER) or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--server {self.url!r}: give an http:// or https:// URL")
        self.timeout = _setting(timeout, ENV_TIMEOUT, TIMEOUT)
        self.read_timeout = _setting(read_timeout, ENV_READ_TIMEOUT, READ_TIMEOUT)
        megabytes = None if max_trace_bytes is None else max_trace_bytes / 2**20
        self.max_trace_bytes = int(_setting(megabytes, ENV_MAX_TRACE_MB, MAX_TRACE_BYTES / 2**20) * 2**20)
        # identity: a compressed answer would expand past every cap before it could be counted
        headers = {"accept-encoding": "identity"} | ({"authorization": f"Bearer {check_token(token)}"} if token else {})
        try:
            self._http = httpx.Client(
                base_url=self.url,
                headers=headers,
                timeout=httpx.Timeout(self.timeout, read=self.read_timeout),
                limits=httpx.Limits(max_keepalive_connections=0),  # a connection per request: _Headers watches each
            )
        except (httpx.InvalidURL, ValueError) as exc:
            raise InputError(f"--server {self.url!r}: not a URL ({exc})") from None
        self._info: dict | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        health = self._json("GET", "/health", MAX_JSON_BYTES, self.timeout)  # a status: no work behind it
        _expect(health, "/health", queue=int, running=bool)
        return health

    def info(self) -> dict[str, Any]:
        """The server's model: config (Hugging Face form), dtype, device, ranks, tokenizer, limits
        (asked once: a server serves one model)."""
        if self._info is None:
            info = self._json("GET", "/info", MAX_JSON_BYTES, self.read_timeout)
            _expect(info, "/info", model=str, dtype=str, device=str, ranks=int, config=dict, tokenizer=bool, limits=dict)
            _expect(info["limits"], "/info's limits", max_prompt_tokens=int, max_generate=int)
            if "chat_refusal" not in info or not (info["chat_refusal"] is None or isinstance(info["chat_refusal"], str)):
                raise ServerError(f"the answer to /info from {self.url} is malformed (chat_refusal is not a string)")
            try:
                ModelArgs.from_json(info["config"])
            except (ConfigError, ValueError, TypeError) as exc:
                raise ServerError(f"the model config in /info from {self.url} cannot be read ({_cut(str(exc))})") from None
            self._info = info
        return self._info

    def max_tokens(self) -> int:
        """The most tokens one request runs, prompt and generated together: the served model's own
        positions (its config's max_position_embeddings) when fewer than the server's limits allow."""
        info = self.info()
        limits = info["limits"]
        return min(ModelArgs.from_json(info["config"]).max_seq_len, limits["max_prompt_tokens"] + limits["max_generate"])

    def max_prompt_tokens(self) -> int:
        """The longest prompt the server runs: its limit, or the served model's positions when fewer."""
        return min(self.max_tokens(), self.info()["limits"]["max_prompt_tokens"])

    def encode(self, request: TraceRequest) -> list[int]:
        """The token ids the server would run ``request`` on (checked as /trace checks them)."""
        body, kind = encode_request(request)
        answer = self._json("POST", "/encode", MAX_IDS_BYTES, self.read_timeout, content=body, headers={"content-type": kind})
        ids = answer.get("ids")
        if not isinstance(ids, list) or not all(type(i) is int and i >= 0 for i in ids):
            raise ServerError(f"the answer to /encode from {self.url} is malformed (ids is not a list of token ids)")
        return ids

    def trace_bytes(self, request: TraceRequest, on_progress: Callable[[dict], None] | None = None) -> bytes:
        """The trace file's bytes for ``request``; ``on_progress`` sees each event ({"queued": place},
        {"progress": {"block", "blocks", "step", "steps"}}, and any other the server sends)."""
        body, kind = encode_request(request.check())
        cap = self.trace_cap(request)
        headers = _Headers(self.read_timeout)
        try:
            with self._http.stream(
                "POST", "/trace", content=body, headers={"content-type": kind}, extensions=headers.extensions
            ) as answer:
                headers.arrived()
                chunks = answer.iter_raw()
                if answer.status_code != 200:
                    raise ServerError(_refusal(answer.status_code, _read_most(chunks, MAX_LINE_BYTES, self.read_timeout)[0]))
                return read_answer(chunks, on_progress, cap, self.read_timeout)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) or headers.late:
                raise ServerError(self._timed_out()) from None
            raise ServerError(f"the model server at {self.url} cannot be reached or went away ({_cut(str(exc))})") from None

    def trace(self, request: TraceRequest | None = None, on_progress=None, **fields) -> Trace:
        """A Trace of ``request`` (or of a TraceRequest made of ``fields``), run by the server."""
        if "hooks" in fields:
            raise InputError(
                "hooks= run Python functions in this process; a server runs an intervention graph: "
                "graph=tracing.Graph() (docs/graphs.md)"
            )
        request = request if request is not None else TraceRequest(**fields)
        data = self.trace_bytes(request, on_progress)
        try:
            return Trace.from_bytes(data, f"{self.url}/trace")
        except TraceError as exc:
            raise ServerError(f"the server's trace cannot be read: {_cut(str(exc))}") from None

    def trace_cap(self, request: TraceRequest) -> int:
        """The most bytes a trace of ``request`` may announce: what its sites weigh at the most
        tokens the server runs (its /info), twice over plus room for metadata, and never more than
        ``max_trace_bytes``."""
        info = self.info()
        args = ModelArgs.from_json(info["config"])
        limits = info["limits"]
        prompt = len(request.token_ids) if request.token_ids else limits["max_prompt_tokens"]
        n = max(1, prompt) + max(0, min(request.generate, limits["max_generate"]))
        names = select(args, [*request.record, *(["attribution"] if request.attribute else [])])
        return min(self.max_trace_bytes, 2 * estimate_bytes(args, names, n) + TRACE_SLACK + TRACE_SLACK_PER_TOKEN * n)

    def _json(self, method: str, path: str, cap: int, read_timeout: float, **kwargs) -> dict:
        timeout = httpx.Timeout(self.timeout, read=read_timeout)
        headers = _Headers(read_timeout)
        try:
            with self._http.stream(method, path, timeout=timeout, extensions=headers.extensions, **kwargs) as answer:
                headers.arrived()
                status = answer.status_code
                body, whole = _read_most(answer.iter_raw(), cap if status == 200 else MAX_LINE_BYTES, read_timeout)
        except httpx.HTTPError as exc:
            if isinstance(exc, httpx.TimeoutException) or headers.late:
                raise ServerError(self._timed_out(read_timeout)) from None
            raise ServerError(f"the model server at {self.url} cannot be reached ({_cut(str(exc))})") from None
        if status != 200:
            raise ServerError(_refusal(status, body))
        if not whole:
            raise ServerError(f"the answer to {path} from {self.url} is larger than {cap:,} bytes: not read")
        return _json_object(body, f"the answer to {path} from {self.url}")

    def _timed_out(self, read_timeout: float | None = None) -> str:
        return (
            f"the model server at {self.url} did not answer in time (connecting {self.timeout:g} s, "
            f"reading {read_timeout or self.read_timeout:g} s: {ENV_TIMEOUT}, {ENV_READ_TIMEOUT})"
        )


# --- an answer's bytes, bounded ---------------------------------------------------------------------


class _Headers:
    """A deadline for an answer's status line and headers (and a TLS handshake before them):
    httpx's read timeout restarts with every byte, so a server that drips its headers would hold
    the client as long as it liked. A timer armed once connected shuts the socket down; the request
    then fails, and ``late`` says why."""

    def __init__(self, seconds: float):
        self.seconds, self.late, self.timer = seconds, False, None
        self.extensions = {"trace": self._event}

    def _event(self, name: str, info: dict) -> None:
        if name == "connection.connect_tcp.complete":
            sock = info["return_value"].get_extra_info("socket")
            self.timer = threading.Timer(self.seconds, self._expire, (sock,))
            self.timer.daemon = True
            self.timer.start()

    def _expire(self, sock: socket.socket) -> None:
        self.late = True
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes the read that waits on it
        except OSError:
            pass

    def arrived(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _Stalled(Exception):
    """Bytes kept coming, too few to make a line (or a trace's next MiB) within the read timeout."""


class _Bytes:
    """The bytes of an answer as they arrive, in one growing buffer: each line (or each STEADY_BYTES
    of a trace) must arrive within ``read_timeout`` of the last, so a server that drips a byte at a
    time is as stalled as one that sends nothing; httpx's read timeout alone, which every byte
    restarts, would wait on it for ever."""

    def __init__(self, chunks: Iterator[bytes], read_timeout: float):
        self.chunks, self.read_timeout, self.buffer = iter(chunks), read_timeout, bytearray()

    def more(self, deadline: float) -> bool:
        """One more chunk into the buffer; False at the answer's end."""
        if time.monotonic() > deadline:
            raise _Stalled
        chunk = next(self.chunks, None)
        if chunk is None:
            return False
        self.buffer += chunk
        return True

    def line(self, cap: int) -> bytes | None:
        """The next line (without its newline), None at the answer's end; ServerError past ``cap``."""
        deadline = time.monotonic() + self.read_timeout
        searched = 0
        while (end := self.buffer.find(b"\n", searched)) < 0:
            searched = len(self.buffer)
            if searched > cap:
                break
            if not self.more(deadline):
                return None
        if end < 0 or end > cap:
            start = bytes(self.buffer[:cap])
            if _ERROR_START.match(start):  # an error too long to read whole: its start is still the server's word
                raise ServerError(f"the server says: {_said(start)} (a message of more than {cap:,} bytes, cut)")
            raise ServerError(f"the server sent a line longer than {cap:,} bytes: {_said(start)}")
        line = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return line

    def exactly(self, size: int) -> bytes:
        deadline, steady = time.monotonic() + self.read_timeout, len(self.buffer) + STEADY_BYTES
        while len(self.buffer) < size:
            if not self.more(deadline):
                raise ServerError(f"the server sent {len(self.buffer):,} of the trace's {size:,} bytes, then stopped")
            if len(self.buffer) >= steady:
                deadline, steady = time.monotonic() + self.read_timeout, len(self.buffer) + STEADY_BYTES
        if len(self.buffer) > size:
            raise ServerError(f"the server sent more than the trace's {size:,} bytes")
        data = bytes(self.buffer)
        self.buffer.clear()
        return data


def read_answer(
    chunks: Iterator[bytes],
    on_event: Callable[[dict], None] | None = None,
    max_trace_bytes: int = MAX_TRACE_BYTES,
    read_timeout: float = READ_TIMEOUT,
) -> bytes:
    """The trace bytes from an answer's stream (tracing.server.wire), calling ``on_event(dict)``
    for each event line; ServerError for the server's error line and for anything malformed or
    over a cap (a line over MAX_LINE_BYTES, a trace announced over ``max_trace_bytes``)."""
    stream = _Bytes(chunks, read_timeout)
    try:
        while (line := stream.line(MAX_LINE_BYTES)) is not None:
            if not line.strip():  # a blank heartbeat
                continue
            message = _event(line)
            if "error" in message:
                raise ServerError(f"the server says: {_said(line)}")
            if "trace" in message:
                size = message["trace"]
                if type(size) is not int or size < 0:
                    raise ServerError(f"the server announced a trace of {_cut(repr(size))} bytes")
                if size > max_trace_bytes:
                    raise ServerError(
                        f"the server announced a trace of {size:,} bytes, more than this request can make "
                        f"({max_trace_bytes:,}; {ENV_MAX_TRACE_MB} sets the most)"
                    )
                return stream.exactly(size)
            if on_event is not None:
                on_event(message)
    except _Stalled:
        raise ServerError(
            f"the model server sent too little to go on for {read_timeout:g} s (it stalled or drips; {ENV_READ_TIMEOUT})"
        ) from None
    raise ServerError("the server ended the answer before the trace (it stopped or lost a rank)")


def _event(line: bytes) -> dict:
    """One event of the stream, its known kinds' fields checked (the CLI and the app read them)."""
    message = _json_object(line, "a line the server sent")
    if "queued" in message and not _count(message["queued"]):
        raise ServerError(f"the server sent a malformed queue place: {_cut(line)}")
    if "progress" in message:
        p = message["progress"]
        fields = ("block", "blocks", "step", "steps")
        if not (isinstance(p, dict) and all(_count(p.get(k)) for k in fields) and p["block"] <= p["blocks"] >= 1):
            raise ServerError(f"the server sent malformed progress: {_cut(line)}")
    return message


def _json_object(data: bytes, what: str) -> dict:
    """``data`` read as a JSON object; one ServerError line naming ``what`` otherwise."""
    try:
        value = json.loads(data)
    except (ValueError, RecursionError):
        raise ServerError(f"{what} is not JSON: {_cut(data)}") from None
    if not isinstance(value, dict):
        raise ServerError(f"{what} is not a JSON object: {_cut(data)}")
    return value


def _count(value) -> bool:
    return type(value) is int and 0 <= value < 2**31


def _read_most(chunks: Iterator[bytes], cap: int, read_timeout: float) -> tuple[bytes, bool]:
    """(the answer's first ``cap`` bytes, whether that is all of it), within the read timeout."""
    stream = _Bytes(chunks, read_timeout)
    deadline = time.monotonic() + read_timeout
    try:
        while len(stream.buffer) <= cap:
            if not stream.more(deadline):
                return bytes(stream.buffer), True
    except _Stalled:
        raise httpx.ReadTimeout("stalled") from None
    return bytes(stream.buffer[:cap]), False


_ERROR_START = re.compile(rb'\s*\{\s*"error"\s*:\s*"')


def _said(data: bytes) -> str:
    """The server's message in a JSON ``{"error": "..."}``, whole or cut off by a cap, cut to
    MESSAGE_CHARS for people; the raw bytes (cut) when it is no such object."""
    try:
        message = json.loads(data)
        if isinstance(message, dict) and isinstance(message.get("error"), str):
            return _cut(message["error"])
    except (ValueError, RecursionError):
        pass
    if (start := _ERROR_START.match(data)) is not None:
        text = data[start.end() : start.end() + 8 * MESSAGE_CHARS].decode("utf-8", "replace")
        for end in range(len(text), max(len(text) - 6, -1), -1):  # an escape the cap cut in two
            try:
                return _cut(json.decoder.scanstring(text[:end] + '"', 0)[0])
            except ValueError:
                continue
    return _cut(data)


def _refusal(status: int, body: bytes) -> str:
    if _ERROR_START.match(body):
        return f"the server says: {_said(body)} ({status})"
    return f"the server answered {status}" + (f": {_cut(body)}" if body.strip() else "")


def _cut(text: str | bytes) -> str:
    """``text`` as one line of printable characters, at most MESSAGE_CHARS of them."""
    if isinstance(text, bytes):
        text = text[: 8 * MESSAGE_CHARS].decode("utf-8", "replace")
    text = " ".join("".join(c if c.isprintable() else " " for c in text[: 8 * MESSAGE_CHARS]).split())
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 1] + "…"


def _expect(answer: dict, what: str, **types: type) -> None:
    for key, kind in types.items():
        value = answer.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ServerError(f"the answer to {what} is malformed ({key!r} is not {kind.__name__})")


def _setting(given: float | None, env: str, default: float) -> float:
    """A timeout or cap: the argument, else the environment variable, else the default."""
    if given is None:
        text = os.environ.get(env, "").strip()
        if not text:
            return default
        from .cli.inputs import parse_float

        given = parse_float(text, env)
    if not (math.isfinite(given) and given > 0):
        raise InputError(f"{env} {given}: must be a positive number")
    return float(given)
