"""The server's HTTP side (Starlette, served by uvicorn on rank 0's second thread).

    GET  /health   200 {"model", "dtype", "device", "ranks", "stream", "load", "queue", "running"} once the model is
                   loaded ("load": held or streamed, what a request reads from disk, rank 0's memory plan; streamed,
                   "streamed": rank 0's disk_bytes, host_bytes and device_hit_bytes over every request); 503 before
    GET  /info     the model's config and vocabulary facts, what a client needs to build requests
    POST /encode   a request's token ids, checked as /trace checks them
    POST /trace    a request; the answer streams its place, its progress and heartbeats, then the trace file (tracing.server.wire)

With a token (``--token-file``), every route but /health asks for ``Authorization: Bearer
<token>``, compared in constant time. A request that cannot run (malformed, over a limit, a site or
intervention the model lacks) is answered 4xx with one line before it is queued; the server goes on.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InputError
from ..tokenizer import TokenizerError
from .wire import EVENTS, HEARTBEAT, Limits, TooLarge, decode_request, event
from .worker import Job, Model, Queue, QueueFull, check

log = logging.getLogger("tracing.server")
BAD_INPUT = (InputError, TokenizerError, ValueError)


@dataclass
class State:
    """What the routes share: the model once loaded, the queue, the limits, the token."""

    limits: Limits
    jobs: Queue
    token: str | None = None
    model: Model | None = None
    facts: dict = field(default_factory=dict)  # /health's and /info's answer, made once loaded


def _refuse(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def make_app(state: State) -> Starlette:
    def authorised(request: Request) -> bool:
        if state.token is None:
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {state.token}".encode())

    def guarded(handler):
        async def endpoint(request: Request) -> Response:
            if not authorised(request):
                return _refuse(401, "this server needs its token: Authorization: Bearer <token> (--token-file)")
            if state.model is None:
                return _refuse(503, "the model is still loading")
            try:
                return await handler(request)
            except BAD_INPUT as exc:
                return _refuse(413 if isinstance(exc, TooLarge) else 422, _line(exc))
            except Exception as exc:  # noqa: BLE001 - a fault of the server's own: one line, and it goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return _refuse(500, f"the server failed on this request ({type(exc).__name__}: {_line(exc)[:200]})")

        return endpoint

    async def body_of(request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > state.limits.max_body_bytes:
            raise TooLarge(f"the request body is larger than this server takes ({state.limits.max_body_bytes / 2**20:.3g} MiB)")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > state.limits.max_body_bytes:
                raise TooLarge(
                    f"the request body is larger than this server takes ({state.limits.max_body_bytes / 2**20:.3g} MiB)"
                )
        return bytes(body)

    async def parsed(request: Request):
        body = await body_of(request)
        trace_request = decode_request(body, request.headers.get("content-type", ""), state.limits)
        ids = await asyncio.to_thread(check, trace_request, state.model, state.limits)  # the tokenizer runs here
        return trace_request, ids

    async def health(request: Request) -> Response:
        if state.model is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        running = state.jobs.running is not None
        body = {**state.facts["health"], "queue": len(state.jobs), "running": running}
        if state.model.loaded.stream:  # rank 0's weights over every request so far: disk, host tier, device tier
            body["streamed"] = {"disk_bytes": 0, "host_bytes": 0, "device_hit_bytes": 0, **state.model.streamed}
        return JSONResponse(body)

    async def info(request: Request) -> Response:
        return JSONResponse(state.facts["info"])

    async def encode(request: Request) -> Response:
        _, ids = await parsed(request)
        return JSONResponse({"ids": ids})

    async def trace(request: Request) -> Response:
        trace_request, _ = await parsed(request)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(
            trace_request, lambda e: loop.call_soon_threadsafe(events.put_nowait, e), time.monotonic() + state.limits.max_seconds
        )
        try:
            state.jobs.put(job)
        except QueueFull as exc:
            return _refuse(503, str(exc))

        async def stream():
            done, started = False, time.monotonic()
            try:
                while True:
                    try:  # a line at least every HEARTBEAT seconds, so a client may read with a timeout
                        message = await asyncio.wait_for(events.get(), HEARTBEAT)
                    except asyncio.TimeoutError:  # noqa: UP041 - a name of its own before Python 3.11
                        yield event(heartbeat=round(time.monotonic() - started, 1))
                        continue
                    if "trace" in message:
                        data = message["trace"]
                        yield event(trace=len(data))
                        yield data
                        done = True
                        return
                    yield event(**message)
                    if "error" in message:
                        done = True
                        return
            finally:
                if not done:  # the client went away (or pressed Stop): end the request at the next block
                    job.cancel("the client went away")
                    state.jobs.remove(job)
                    log.info("request ended: its client went away")

        return StreamingResponse(stream(), media_type=EVENTS)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/info", guarded(info), methods=["GET"]),
        Route("/encode", guarded(encode), methods=["POST"]),
        Route("/trace", guarded(trace), methods=["POST"]),
    ]
    return Starlette(routes=routes)


def _line(exc: Exception) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
