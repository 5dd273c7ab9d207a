"""A model server that misbehaves, on loopback, for the clients' tests: it answers /health,
/info and /encode as a server of the tiny config does, and then, as its ``mode`` says, drips its
answer or its headers a byte at a time, sends one endless line, a huge /info, malformed JSON, a 20 MB error, a
trace that is no safetensors file or one announced at a petabyte; or it works longer than a read
timeout, saying so every 0.2 s, and sends a real trace. It counts the bytes it managed to
send, so a test sees that the client stopped reading (the socket's buffers hold a few MB at most)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from model import TINY

CHUNK = b"a" * 65536
HUGE = 200 * 2**20  # what an endless answer would send: far past every cap
ERROR_BYTES = 20 * 2**20
INFO = {
    "model": "tiny",
    "dtype": "bfloat16",
    "device": "cpu",
    "ranks": 1,
    "stream": False,
    "config": TINY.to_hf(),
    "tokenizer": True,
    "chat_refusal": None,
    "limits": {"max_prompt_tokens": 64, "max_generate": 8, "max_seconds": 600.0, "max_queue": 8},
}
HEALTH = {key: INFO[key] for key in ("model", "dtype", "device", "ranks", "stream")} | {"queue": 0, "running": False}


def _endless(head: bytes, total: int = HUGE, tail: bytes = b"") -> Iterator[bytes]:
    yield head
    for _ in range(total // len(CHUNK)):
        yield CHUNK
    yield tail


def _drip(head: bytes) -> Iterator[bytes]:
    yield head
    for _ in range(600):  # 30 s of a byte every 50 ms, unless the client goes first
        time.sleep(0.05)
        yield b" "


def _working(trace: bytes) -> Iterator[bytes]:
    """A server that works longer than the read timeout, saying so every 0.2 s, then sends its trace."""
    yield QUEUED
    for block in range(1, 8):
        time.sleep(0.2)
        yield b"\n" if block % 2 else b'{"heartbeat": %d}\n' % block
        yield b'{"progress": {"block": %d, "blocks": 7, "step": 0, "steps": 0}}\n' % block
    yield b'{"trace": %d}\n' % len(trace)
    yield trace


def _json(value) -> Iterator[bytes]:
    yield json.dumps(value).encode()


QUEUED = b'{"queued": 1}\n'
TRACES = {  # mode: (status, the answer's chunks) for POST /trace
    "working": lambda trace: (200, _working(trace)),
    "drip": lambda trace: (200, _drip(QUEUED + b'{"progress": ')),
    "huge_line": lambda trace: (200, _endless(QUEUED + b'{"progress": "')),
    "malformed": lambda trace: (200, iter([QUEUED, b"this is not JSON\n"])),
    "wrong_types": lambda trace: (200, iter([b'{"progress": {"block": "3", "blocks": 4}}\n'])),
    "error_20mb": lambda trace: (
        200,
        _endless(QUEUED + b'{"error": "the model ran out of ' + b"x", ERROR_BYTES, b'", "status": 500}\n'),
    ),
    "refusal_20mb": lambda trace: (422, _endless(b'{"error": "your request is ' + b"x", ERROR_BYTES, b'"}')),
    "not_safetensors": lambda trace: (200, iter([QUEUED, b'{"trace": 16}\n', b"0123456789abcdef"])),
    "petabyte_trace": lambda trace: (200, iter([b'{"trace": 1000000000000000}\n'])),
}
HEALTHS = {  # mode: GET /health's answer (a streamed server's byte totals, right and wrong)
    "streamed": {**HEALTH, "streamed": {"disk_bytes": 2 * 10**9, "host_bytes": 0, "device_hit_bytes": 5 * 10**8}},
    "wrong_streamed": {**HEALTH, "streamed": {"disk_bytes": "lots", "host_bytes": 10**400, "device_hit_bytes": -1}},
}
INFOS = {  # mode: the answer's chunks for GET /info
    "huge_info": lambda: _endless(b'{"model": "tiny", "padding": "', HUGE, b'"}'),
    "malformed_info": lambda: iter([b'{"model": "tiny", "config": {']),
    "wrong_info": lambda: _json({**INFO, "ranks": "eight"}),
}


class Hostile(ThreadingHTTPServer):
    daemon_threads = True
    mode = "good"
    sent = 0  # bytes of the last answer that reached the socket
    trace = b""  # what the "working" mode sends in the end

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: Hostile

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        if self.path == "/info" and self.server.mode == "drip_info_headers":
            self._drip_headers()
        elif self.path == "/info" and self.server.mode in INFOS:
            self._answer(200, INFOS[self.server.mode]())
        elif self.path == "/health" and self.server.mode == "drip":
            self._answer(200, _drip(b'{"queue": '))
        elif self.path == "/health" and self.server.mode in HEALTHS:
            self._answer(200, _json(HEALTHS[self.server.mode]))
        else:
            self._answer(200, _json(INFO if self.path == "/info" else HEALTH))

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/encode":
            self._answer(200, _json({"ids": [1, 2, 3]}))
        elif self.server.mode == "drip_headers":
            self._drip_headers()
        else:
            self._answer(*TRACES[self.server.mode](self.server.trace))

    def _drip_headers(self) -> None:
        """A status line, then one header a byte at a time: no body ever starts."""
        self._send(_drip(b"HTTP/1.0 200 OK\r\nX-Drip: "))

    def _answer(self, status: int, chunks: Iterator[bytes]) -> None:
        self.server.sent = 0
        self.send_response(status)
        self.send_header("content-type", "application/x-ndjson")
        self.end_headers()
        self._send(chunks)

    def _send(self, chunks: Iterator[bytes]) -> None:
        try:
            for chunk in chunks:
                self.wfile.write(chunk)
                self.server.sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped reading: what the tests want


@contextmanager
def hostile_server() -> Iterator[Hostile]:
    server = Hostile(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
