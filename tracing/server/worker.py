"""The model's side of the server: one request at a time through the model, on every rank.

Rank 0's HTTP thread puts checked requests on a bounded :class:`Queue`; rank 0's main thread
(:func:`lead`) takes them one at a time, sends each to the other ranks as the client sent it
(tracing.server.ranks: kind, content type, length, then the bytes, over torch.distributed: no
pickle), and every rank runs it (:func:`follow`). While idle rank 0 sends a heartbeat every few
seconds, so a rank that died shows within the collectives' timeout. Every rank agrees on each
request's outcome (tracing.server.ranks.Ranks.agree) before each block and each decode step and
at its end: a client that went away, pressed Stop or ran past the time limit, or an exception on
any rank, ends the request there on every rank, the client gets one line, and the server goes on;
ranks that lost step end the server with the reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..analyses.graph import check_graph
from ..analyses.interventions import check_patch
from ..errors import InputError
from ..runner import TraceRequest, run
from ..sites import select, site_legend, site_shape, spec
from .ranks import (
    BROKEN,
    DONE,
    FAILED,
    GOING_ON,
    OUT_OF_MEMORY,
    STOPPED,
    Agreed,
    Broken,
    Fault,
    Kind,
    Ranks,
    Verdict,
    fire,
    free_cached_memory,
    outcome,
)
from .wire import Limits, decode_request, encode_request

log = logging.getLogger("tracing.server")
TOKEN_CHARS = 1000  # a --target or --contrast text longer than this is no token of any tokenizer


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
        self.closed: str | None = None  # why the server takes no more requests

    def put(self, job: Job) -> None:
        with self._cond:
            if self.closed is not None:
                raise QueueFull(self.closed)
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

    def close(self, why: str) -> None:
        """No more requests: each waiting one is answered ``why``."""
        with self._cond:
            self.closed = why
            for job in self._jobs:
                job.emit({"error": why, "status": 503})
            self._jobs.clear()

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
    faults: list[Fault] = field(default_factory=list)  # tests of the failure paths (ranks.faults_from_env)
    requests: int = 0  # the requests that reached this rank
    dictionaries: dict = field(default_factory=dict)  # name -> Dictionary (serve --dictionaries): what a request names
    streamed: dict = field(default_factory=dict)  # streamed: this rank's bytes of every request, by where they came from

    def __post_init__(self) -> None:
        for block in {fault.block for fault in self.faults if fault.kind == "mid"}:
            ffn = self.loaded.model.layers[block].ffn  # after the block's attention's collectives, before its FFN's
            ffn.register_forward_pre_hook(lambda module, args, b=block: fire(self.faults, self.requests, b, ("mid",)))

    def run(self, request: TraceRequest, on_block, on_step):
        loaded = self.loaded
        trace = run(
            loaded.model,
            request,
            loaded.tokenizer,
            on_block=on_block,
            on_step=on_step,
            extra={"checkpoint": loaded.label},
            device=loaded.device,
            context=loaded.context(),
            plan=loaded.plan,
            dictionaries=self.dictionaries,
        )
        for key, value in trace.extra.get("stream", {}).items():
            if key.endswith("_bytes"):
                self.streamed[key] = self.streamed.get(key, 0) + value
        return trace


def check(request: TraceRequest, model: Model, limits: Limits) -> list[int]:
    """Everything rank 0 can check before a request is queued (its token ids, as they will run)."""
    from ..analyses.intervention_specs import check_positions
    from ..runner import (
        attribution_of,
        check_gradient,
        check_prefill,
        check_token_ids,
        dictionaries_of,
        encode,
        interventions_of,
    )

    _within_limits(request, limits)
    request.check()
    if request.generate > limits.max_generate:
        raise InputError(f"--generate {request.generate}: this server writes at most {limits.max_generate} tokens")
    ids = encode(request, model.loaded.tokenizer)
    if len(ids) > limits.max_prompt_tokens:
        raise InputError(f"the prompt has {len(ids)} tokens; this server takes at most {limits.max_prompt_tokens}")
    args = model.loaded.model.args
    check_token_ids(ids, args, None, request.generate)
    n_positions = len(ids) + request.generate
    if request.prefill is not None:
        check_prefill(request.prefill, len(ids))
    if request.gradient_of is not None:  # what its backward pass needs: one prefill, the weights held
        check_gradient(request.gradient_of, args, False, model.loaded.plan, bool(model.loaded.stream))
        if len(ids) > limits.max_gradient_tokens:
            most = limits.max_gradient_tokens
            raise InputError(
                f"gradient_of: the prompt has {len(ids)} tokens; this server takes a backward pass of at most {most}"
            )
    if (attribution := attribution_of(request, model.loaded.tokenizer)) is not None:
        attribution.check(n_positions, args.vocab_size)
    chosen = dictionaries_of(request, model.loaded.model, model.dictionaries)  # by name: the server's only
    interventions, _ = interventions_of(request, chosen, model.loaded.model)
    for intervention in interventions:  # their blocks, experts, heads, top-k and features against this model
        intervention.replacements(args)
        intervention.config(args)
    check_positions(interventions, n_positions)
    if request.graph is not None:  # its sites, positions and every shape, on meta tensors
        check_graph(request.graph, args, len(ids), request.generate, request.prefill)
    select(args, list(request.record))  # a pattern that matches no site
    for name, value in (request.patches or {}).items():
        legend = site_legend(args, name)
        if legend is None or not spec(name).patchable:
            raise InputError(f"patch {name!r} is not a trace site this model can patch")
        check_patch(name, value)
        want = site_shape(args, name, legend[0], len(ids))
        if tuple(value.shape) != want:
            raise InputError(f"patch {name!r} has shape {list(value.shape)}, this run needs {list(want)}")
    return ids


def _within_limits(request: TraceRequest, limits: Limits) -> None:
    """The bounds on what checking a request costs, before it is checked: the site patterns (each is
    matched against every site), the token ids and the text the tokenizer is given."""
    patterns = request.record
    if len(patterns) > limits.max_record_patterns:
        raise InputError(f"--record names {len(patterns)} patterns; this server takes at most {limits.max_record_patterns}")
    if longest := max((p for p in patterns if len(p) > limits.max_pattern_chars), key=len, default=None):
        raise InputError(f"--record pattern {longest[:40]!r}... is {len(longest)} characters; at most {limits.max_pattern_chars}")
    if request.token_ids is not None and len(request.token_ids) > limits.max_prompt_tokens:
        raise InputError(f"the prompt has {len(request.token_ids)} tokens; this server takes at most {limits.max_prompt_tokens}")
    if request.prompt is not None and len(request.prompt) > limits.max_prompt_chars:
        most = limits.max_prompt_chars
        raise InputError(f"the prompt has {len(request.prompt):,} characters; this server takes at most {most:,}")
    for flag, text in (("--target", request.target), ("--contrast", request.contrast)):
        if isinstance(text, str) and len(text) > TOKEN_CHARS:
            raise InputError(f"{flag}: {len(text):,} characters, more than one token holds ({TOKEN_CHARS})")


# --- the ranks' loop ---------------------------------------------------------------------------------


def _run(model: Model, ranks: Ranks, request: TraceRequest | None, job: Job | None, failure=None) -> tuple[Verdict, bytes]:
    """One request on this rank, ended by an agreement of every rank: (the verdict, rank 0's trace
    bytes when it is DONE). ``failure``: (code, reason) of a request this rank could not decode."""
    n_layers = model.loaded.model.args.n_layers
    state = {"step": 0, "steps": 0}

    def agreed(code: int, reason: str = "") -> None:  # a place every rank passes: go on, or end here together
        verdict = ranks.agree(code, reason)
        if not verdict.going_on:
            raise Agreed(verdict)

    def stop_here() -> None:
        code, reason = GOING_ON, ""
        if job is not None:
            if time.monotonic() > job.deadline:
                job.cancel("the request ran past this server's time limit")
            if job.cancelled.is_set():
                code, reason = STOPPED, f"stopped: {job.why}"
        agreed(code, reason)

    def on_block(i: int) -> None:
        fire(model.faults, model.requests, i, ("error", "oom"))
        stop_here()
        if job is not None:
            job.emit({"progress": {"block": i + 1, "blocks": n_layers, "step": state["step"], "steps": state["steps"]}})

    def on_step(step: int, steps: int) -> None:
        state.update(step=step, steps=steps)
        stop_here()

    model.requests += 1
    code, reason, data, verdict = DONE, "", b"", None
    try:
        if failure is not None:
            code, reason = failure
        else:
            agreed(GOING_ON)  # every rank holds the request
            trace = model.run(request, on_block, on_step)
            data = trace.to_bytes() if job is not None else b""
    except Agreed as exc:
        verdict = exc.verdict
    except Broken:
        raise
    except Exception as exc:  # noqa: BLE001 - any exception on a rank is an outcome the ranks agree on
        code, reason = outcome(exc)
        log.log(logging.WARNING if code >= FAILED else logging.INFO, "request ended on rank %d: %s", ranks.rank, reason)
    if verdict is None:  # this rank came to the request's end (done, or its own exception): the final agreement
        verdict = ranks.agree(code, reason)
    if verdict.code == OUT_OF_MEMORY:  # on every rank: the one that ran out frees its cache, the others theirs
        free_cached_memory()
    return verdict, data if verdict.code == DONE else b""


def lead(model: Model, jobs: Queue, stopping: threading.Event, heartbeat: float = 5.0, ranks: Ranks | None = None) -> str | None:
    """Rank 0's loop: each request through the model, in turn, until ``stopping`` (returns None) or
    until the ranks cannot go on (returns the reason; every waiting client is told it)."""
    ranks = ranks or Ranks()
    broken = None
    try:
        while not stopping.is_set():
            job = jobs.take(timeout=heartbeat)
            if job is None:
                ranks.send(Kind.HEARTBEAT)
                continue
            try:
                data, content = encode_request(job.request)
            except Exception as exc:  # noqa: BLE001 - checked, yet not sendable: this request's answer, not the server's end
                verdict = Verdict(*outcome(exc))
                job.emit({"error": verdict.reason, "status": verdict.status})
                continue
            jobs.running = job
            try:
                ranks.send(Kind.REQUEST, content, data)
                verdict, trace = _run(model, ranks, job.request, job)
                if verdict.code == DONE:
                    job.emit({"trace": trace})
                else:
                    job.emit({"error": verdict.reason, "status": verdict.status})
                if verdict.code == BROKEN:
                    broken = verdict.reason
                    break
            except Broken as exc:
                job.emit({"error": f"{exc}; the server stops", "status": FAILED})
                raise
            finally:
                jobs.running = None
        if broken is None:
            ranks.send(Kind.STOP)
    except Broken as exc:
        broken = str(exc)
    if broken is not None:
        jobs.close(f"the server stopped: {broken}")
    return broken


def follow(model: Model, limits: Limits, ranks: Ranks) -> str | None:
    """Every other rank's loop: run what rank 0 sends, until it says stop (returns None) or the ranks
    cannot go on (returns the reason)."""
    try:
        while True:
            kind, content, body = ranks.receive()
            if kind == Kind.STOP:
                return None
            if kind != Kind.REQUEST:
                continue
            request, failure = None, None
            try:
                request = decode_request(body, content or "", limits)
            except Exception as exc:  # noqa: BLE001 - rank 0 decoded these bytes: the ranks agree it cannot run
                failure = outcome(exc)
            verdict, _ = _run(model, ranks, request, None, failure)
            if verdict.code == BROKEN:
                return verdict.reason
    except Broken as exc:
        return str(exc)


__all__ = ["Job", "Model", "Queue", "QueueFull", "check", "follow", "lead"]
