"""The model's side of the server: one request at a time through the model, on every rank.

Rank 0's HTTP thread puts checked requests on a bounded :class:`Queue`; rank 0's main thread
(:func:`lead`) takes them one at a time, hands each to the other ranks (its body as a uint8
tensor, broadcast over torch.distributed: no pickle), and every rank runs it (:func:`follow`).
While idle rank 0 broadcasts a heartbeat every few seconds, so a rank that died shows within the
collectives' timeout. Before each block and each decode step every rank asks rank 0 whether to go
on (one broadcast): a client that went away, pressed Stop or ran past the time limit ends the
request there on every rank, and the server goes on serving.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum

import torch
import torch.distributed as dist

from ..errors import InputError
from ..runner import TraceRequest, run
from ..sites import select, site_legend, site_shape, spec
from .wire import JSON, SAFETENSORS, Limits, decode_request, encode_request


class Message(IntEnum):
    """What rank 0 broadcasts to the other ranks."""

    HEARTBEAT = 0
    REQUEST = 1
    STOP = 2


class Cancelled(Exception):
    """The request ends here: its client went away or asked, or it ran out of time."""


@dataclass
class Job:
    """One request on its way through the model: its events go to ``emit`` (called from the model's
    thread), ``cancelled`` is set by the HTTP side."""

    request: TraceRequest
    emit: Callable[[dict], None]
    deadline: float
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str = "the client went away"

    def cancel(self, why: str) -> None:
        self.why = why
        self.cancelled.set()


class Queue:
    """The requests waiting for the model, at most ``limit``; each waiting one is told its place."""

    def __init__(self, limit: int):
        self.limit = limit
        self._jobs: list[Job] = []
        self._cond = threading.Condition()
        self.running: Job | None = None

    def put(self, job: Job) -> None:
        with self._cond:
            if len(self._jobs) >= self.limit:
                raise QueueFull(f"the server's queue is full ({self.limit} waiting): try again later")
            self._jobs.append(job)
            self._tell_places()
            self._cond.notify()

    def take(self, timeout: float) -> Job | None:
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout)
            while self._jobs:
                job = self._jobs.pop(0)
                self._tell_places()
                if not job.cancelled.is_set():
                    return job
            return None

    def remove(self, job: Job) -> None:
        with self._cond:
            if job in self._jobs:
                self._jobs.remove(job)
                self._tell_places()

    def __len__(self) -> int:
        return len(self._jobs)

    def _tell_places(self) -> None:
        for place, job in enumerate(self._jobs, 1):
            job.emit({"queued": place})


class QueueFull(Exception):
    pass


@dataclass
class Model:
    """What every rank holds: its part of the model and how to run a request on it."""

    loaded: object  # tracing.cli.loading.Loaded
    world: int = 1
    device: torch.device = torch.device("cpu")

    def run(self, request: TraceRequest, on_block, on_step):
        loaded = self.loaded
        return run(
            loaded.model,
            request,
            loaded.tokenizer,
            on_block=on_block,
            on_step=on_step,
            extra={"checkpoint": loaded.label},
            device=loaded.device,
            context=loaded.context(),
            plan=loaded.plan,
        )


def check(request: TraceRequest, model: Model, limits: Limits) -> list[int]:
    """Everything rank 0 can check before a request is queued (its token ids, as they will run)."""
    from ..runner import check_token_ids, encode

    request.check()
    if request.generate > limits.max_generate:
        raise InputError(f"--generate {request.generate}: this server writes at most {limits.max_generate} tokens")
    ids = encode(request, model.loaded.tokenizer)
    if len(ids) > limits.max_prompt_tokens:
        raise InputError(f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens}")
    args = model.loaded.model.args
    check_token_ids(ids, args, None, request.generate)
    select(args, list(request.record))  # a pattern that matches no site
    for name, value in (request.patches or {}).items():
        legend = site_legend(args, name)
        if legend is None or not spec(name).patchable:
            raise InputError(f"patch {name!r} is not a trace site this model can patch")
        want = site_shape(args, name, legend[0], len(ids))
        if tuple(value.shape) != want:
            raise InputError(f"patch {name!r} has shape {list(value.shape)}, this run needs {list(want)}")
    return ids


# --- the ranks' loop ---------------------------------------------------------------------------------


def _broadcast_bytes(data: bytes | None, kind: Message, device: torch.device) -> tuple[Message, bytes]:
    """Rank 0's (kind, bytes) on every rank: a header (kind, length), then the bytes."""
    head = torch.tensor([int(kind), len(data or b"")], dtype=torch.int64, device=device)
    dist.broadcast(head, src=0)
    kind, size = Message(int(head[0])), int(head[1])
    body = torch.empty(size, dtype=torch.uint8, device=device)
    if dist.get_rank() == 0 and size:
        body.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    if size:
        dist.broadcast(body, src=0)
    return kind, bytes(body.cpu().numpy()) if size else b""


def _agree(stop: bool, world: int, device: torch.device) -> bool:
    """Rank 0's decision to stop, on every rank (one broadcast; none in one process)."""
    if world == 1:
        return stop
    flag = torch.tensor([int(stop)], dtype=torch.int64, device=device)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def _callbacks(model: Model, job: Job | None):
    """on_block and on_step for one request: progress for the client, and the place to stop."""
    n_layers = model.loaded.model.args.n_layers
    state = {"step": 0, "steps": 0}

    def stop_here() -> None:
        stop = False
        if job is not None:
            if time.monotonic() > job.deadline:
                job.cancel("the request ran past this server's time limit")
            stop = job.cancelled.is_set()
        if _agree(stop, model.world, model.device):
            raise Cancelled(job.why if job is not None else "cancelled")

    def on_block(i: int) -> None:
        stop_here()
        if job is not None:
            job.emit({"progress": {"block": i + 1, "blocks": n_layers, "step": state["step"], "steps": state["steps"]}})

    def on_step(step: int, steps: int) -> None:
        state.update(step=step, steps=steps)
        stop_here()

    return on_block, on_step


def lead(model: Model, jobs: Queue, stopping: threading.Event, heartbeat: float = 5.0) -> None:
    """Rank 0's loop: each request through the model, in turn, until ``stopping``."""
    while not stopping.is_set():
        job = jobs.take(timeout=heartbeat)
        if job is None:
            if model.world > 1:
                _broadcast_bytes(None, Message.HEARTBEAT, model.device)
            continue
        jobs.running = job
        try:
            if model.world > 1:
                _broadcast_bytes(encode_request(job.request)[0], Message.REQUEST, model.device)
            on_block, on_step = _callbacks(model, job)
            job.emit({"trace": model.run(job.request, on_block, on_step).to_bytes()})
        except Cancelled as exc:
            job.emit({"error": f"stopped: {exc}", "status": 499})
        except InputError as exc:
            job.emit({"error": str(exc), "status": 422})
        finally:
            jobs.running = None
    if model.world > 1:
        _broadcast_bytes(None, Message.STOP, model.device)


def follow(model: Model, limits: Limits) -> None:
    """Every other rank's loop: run what rank 0 hands out, until it says stop."""
    while True:
        kind, body = _broadcast_bytes(None, Message.HEARTBEAT, model.device)
        if kind == Message.STOP:
            return
        if kind != Message.REQUEST:
            continue
        content_type = SAFETENSORS if body[:1] != b"{" else JSON
        request = decode_request(body, content_type, limits)
        on_block, on_step = _callbacks(model, None)
        try:
            model.run(request, on_block, on_step)
        except (Cancelled, InputError):
            pass  # rank 0 answers; every rank stopped at the same place


__all__ = ["Cancelled", "Job", "Message", "Model", "Queue", "QueueFull", "check", "follow", "lead"]
