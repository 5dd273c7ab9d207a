"""A model server's client: ``Client(url, token).trace(...)`` returns a Trace, as tracing.run does
in this process (the server runs the same request: the same trace file's bytes).

    from tracing.client import Client
    client = Client("http://127.0.0.1:8600")
    trace = client.trace(prompt="It is a truth", generate=8, on_progress=print)
    client.health()   # {"model", "dtype", "device", "ranks", "queue", "running"}

Errors read as InputError with the server's own line (a bad request, a full queue, a wrong token);
a server that cannot be reached says so. Leaving ``trace`` early (an exception raised by
``on_progress``, Ctrl-C, the app's Stop) closes the connection, and the server ends the request at
its next block.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import httpx

from .errors import InputError
from .runner import TraceRequest
from .server.wire import encode_request, read_answer
from .trace import Trace

DEFAULT_URL = "http://127.0.0.1:8600"
ENV_SERVER = "ANATOMY_SERVER"  # the server's URL, for the app and run --server
ENV_TOKEN_FILE = "ANATOMY_SERVER_TOKEN_FILE"


class Client:
    def __init__(self, url: str | None = None, token: str | None = None, timeout: float = 30.0):
        self.url = (url or os.environ.get(ENV_SERVER) or DEFAULT_URL).rstrip("/")
        if not self.url.startswith(("http://", "https://")):
            raise InputError(f"--server {self.url!r}: give an http:// or https:// URL")
        headers = {"authorization": f"Bearer {token}"} if token else {}
        # connecting and each write have a deadline; reading waits as long as the model runs
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, read=None))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        return self._json("GET", "/health")

    def info(self) -> dict[str, Any]:
        """The server's model: config (Hugging Face form), dtype, device, ranks, tokenizer, limits."""
        return self._json("GET", "/info")

    def encode(self, request: TraceRequest) -> list[int]:
        """The token ids the server would run ``request`` on (checked as /trace checks them)."""
        body, kind = encode_request(request)
        return self._json("POST", "/encode", content=body, headers={"content-type": kind})["ids"]

    def trace_bytes(self, request: TraceRequest, on_progress: Callable[[dict], None] | None = None) -> bytes:
        """The trace file's bytes for ``request``; ``on_progress`` sees each event ({"queued": place},
        {"progress": {"block", "blocks", "step", "steps"}})."""
        body, kind = encode_request(request.check())
        try:
            with self._http.stream("POST", "/trace", content=body, headers={"content-type": kind}) as answer:
                if answer.status_code != 200:
                    answer.read()
                    raise InputError(_message(answer))
                return read_answer(answer.iter_bytes(), on_progress)
        except httpx.TransportError as exc:
            raise InputError(f"the model server at {self.url} cannot be reached or went away ({exc})") from None

    def trace(self, request: TraceRequest | None = None, on_progress=None, **fields) -> Trace:
        """A Trace of ``request`` (or of a TraceRequest made of ``fields``), run by the server."""
        request = request if request is not None else TraceRequest(**fields)
        return Trace.from_bytes(self.trace_bytes(request, on_progress), f"{self.url}/trace")

    def _json(self, method: str, path: str, **kwargs) -> dict:
        try:
            answer = self._http.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise InputError(f"the model server at {self.url} cannot be reached ({exc})") from None
        if answer.status_code != 200:
            raise InputError(_message(answer))
        return answer.json()


def _message(answer: httpx.Response) -> str:
    try:
        return f"the server says: {answer.json()['error']} ({answer.status_code})"
    except (ValueError, KeyError, TypeError):
        return f"the server answered {answer.status_code}"


def read_token_file(path: str | None) -> str | None:
    """A bearer token from a file (stripped), or None."""
    if path is None:
        return None
    from .cli.serve import read_token

    return read_token(path)
