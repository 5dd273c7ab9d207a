"""The model server's HTTP side in this process, for tests: the app of tracing.server.http over a
loaded checkpoint behind Starlette's TestClient, its worker loop on a thread, so a request runs the
model as a served one does without a port or a process."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from starlette.testclient import TestClient

from tracing.cli.loading import Loaded, open_checkpoint
from tracing.runner import TraceRequest
from tracing.server.http import State, make_app
from tracing.server.wire import Limits, encode_request
from tracing.server.worker import Model, Queue, lead

TOKEN = "a-token-of-sixteen-or-more"


@contextmanager
def in_process(checkpoint: str, **options) -> Iterator[tuple[TestClient, State, Loaded]]:
    """(client with the bearer token, server state, loaded model; ``options`` go to
    open_checkpoint: ``stream=True, budgets=...``); the worker stops on leaving."""
    loaded = open_checkpoint(checkpoint, **options)
    state = State(Limits(max_prompt_tokens=64, max_generate=8, max_body_bytes=1 << 20, max_queue=2), Queue(2), TOKEN)
    stopping = threading.Event()
    model = Model(loaded)
    worker = threading.Thread(target=lead, args=(model, state.jobs, stopping, 0.2), daemon=True)
    worker.start()
    state.model, state.facts = model, {"health": {"model": loaded.label}, "info": {"model": loaded.label}}
    try:
        with TestClient(make_app(state)) as client:
            client.headers["authorization"] = f"Bearer {TOKEN}"
            yield client, state, loaded
    finally:
        stopping.set()
        worker.join(10)


def post(client: TestClient, request: TraceRequest):
    body, kind = encode_request(request)
    return client.post("/trace", content=body, headers={"content-type": kind})


@contextmanager
def listening(checkpoint: str) -> Iterator[tuple[str, State, Loaded]]:
    """(URL, server state, loaded model): the same server as :func:`in_process`, listening on a
    loopback port (uvicorn on a thread) with the facts `serve` tells, so a command line's
    ``--server URL`` and tracing.client reach it as they reach `python -m tracing serve`."""
    import socket
    import time

    import uvicorn

    from tracing.cli.serve import _facts

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with in_process(checkpoint) as (_, state, loaded):
        state.token, state.facts = None, _facts(loaded, 1, state.limits)
        server = uvicorn.Server(uvicorn.Config(make_app(state), host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        try:
            yield f"http://127.0.0.1:{port}", state, loaded
        finally:
            server.should_exit = True
            thread.join(10)
