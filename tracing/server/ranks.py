"""How the server's ranks keep in step: rank 0's messages, and the outcome every rank agrees on.

The ranks talk over a control group of their own (gloo, CPU tensors), apart from the group the
model's collectives use: a message or an agreement can never be taken for a step of the forward.

A message (:meth:`Ranks.send`, :meth:`Ranks.receive`) is a header of three int64 (its
:class:`Kind`, its content type as :data:`CONTENT` numbers it, its length in bytes) and then its
bytes: the request exactly as the client sent it, decoded on every rank as rank 0 decoded it.

An agreement (:meth:`Ranks.agree`) is one all-reduce of ``[code, -code]`` (the highest and lowest
code), then, only when some rank stopped or failed, one all-gather of every rank's code and reason.
Every rank calls it at the same places: once a request is decoded, before each block and each
decode step, and once the request ends on that rank. A rank whose request failed calls its final
agreement where the others call their next one; both are the same collective, so all learn the
outcome there and end the request at that point together. A rank whose collective fails (a rank
died, or the model's collectives lost step) cannot go on: the verdict is :data:`BROKEN` and the
server ends.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from ..errors import InputError
from .wire import JSON, SAFETENSORS, TooLarge

log = logging.getLogger("tracing.server")

CONTENT = {0: None, 1: JSON, 2: SAFETENSORS}  # the header's content type numbers
REASON_BYTES = 300  # a reason travels cut to this many bytes of UTF-8

# agreement codes: below STOPPED the request goes on or ended well on that rank; from STOPPED on,
# an HTTP status (the client's answer); BROKEN: the ranks are no longer in step
GOING_ON, DONE = 0, 1
STOPPED = 499  # the client went away or asked, the time limit, a shutdown
FAILED = 500  # an exception on a rank
OUT_OF_MEMORY = 503  # the rank freed its cached memory; a smaller request may run
BROKEN = 600


class Kind(IntEnum):
    """What rank 0 sends the other ranks."""

    HEARTBEAT = 0  # rank 0 is idle and alive
    REQUEST = 1  # a request to run (JSON or safetensors, as the client sent it)
    STOP = 2  # the server ends


class Broken(Exception):
    """The ranks cannot go on together: the server ends with this reason."""


@dataclass(frozen=True)
class Verdict:
    """The outcome every rank agreed on: a code, and the reason for one from STOPPED on."""

    code: int
    reason: str = ""

    @property
    def going_on(self) -> bool:
        return self.code == GOING_ON

    @property
    def status(self) -> int:
        """The HTTP status the client is answered with."""
        return FAILED if self.code == BROKEN else self.code


class Agreed(Exception):
    """Raised inside a run on every rank at the same place: the ranks agreed to end the request there."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.reason)
        self.verdict = verdict


def outcome(exc: BaseException) -> tuple[int, str]:
    """The code and one-line reason of an exception a rank met while running a request."""
    line = _line(exc)
    if isinstance(exc, TooLarge):
        return 413, line
    if isinstance(exc, InputError):
        return 422, line
    if isinstance(exc, torch.OutOfMemoryError):
        free_cached_memory()
        return OUT_OF_MEMORY, f"out of memory ({line}); a shorter request or fewer sites may fit"
    if isinstance(exc, dist.DistError) or _collective_failure(exc):
        return BROKEN, f"a collective failed ({line})"
    return FAILED, f"{type(exc).__name__}: {line}"


def free_cached_memory() -> None:
    """After an out-of-memory: the request's tensors are gone; give their cached blocks back, so the
    next request starts from the memory the model needs."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _collective_failure(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in ("gloo", "nccl"))  # gloo raises RuntimeError


def _line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:REASON_BYTES]


class Ranks:
    """Rank 0 and the others over the control ``group`` (None in one process: nothing to agree).
    ``device``: where the model's collectives run; on a GPU each agreement waits for the work queued
    there, so that a collective still pending (a rank that failed inside a block) is never agreed
    over: it times out instead (under NCCL torch's watchdog then ends the process)."""

    def __init__(self, group=None, rank: int = 0, world: int = 1, device: torch.device | None = None):
        self.group, self.rank, self.world = group, rank, world
        self.device = device if device is not None and device.type == "cuda" else None

    # rank 0's messages -------------------------------------------------------------------------
    def send(self, kind: Kind, content: str | None = None, data: bytes = b"") -> None:
        """Rank 0: a message to every other rank."""
        if self.world == 1:
            return
        code = next(n for n, name in CONTENT.items() if name == content)
        self._collective(self._message, torch.tensor([int(kind), code, len(data)], dtype=torch.int64), data)

    def receive(self) -> tuple[Kind, str | None, bytes]:
        """Another rank: rank 0's next message (kind, content type, bytes)."""
        head = torch.zeros(3, dtype=torch.int64)
        data = self._collective(self._message, head, b"")
        kind, code, _ = (int(v) for v in head)
        if kind not in Kind._value2member_map_ or code not in CONTENT:
            raise Broken(f"rank 0 sent a message this rank cannot read (kind {kind}, content {code})")
        return Kind(kind), CONTENT[code], data

    def _message(self, head: torch.Tensor, data: bytes) -> bytes:
        dist.broadcast(head, src=0, group=self.group)
        size = int(head[2])
        if not size:
            return b""
        body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if self.rank == 0 else torch.empty(size, dtype=torch.uint8)
        dist.broadcast(body, src=0, group=self.group)
        return data if self.rank == 0 else body.numpy().tobytes()

    # every rank's agreement --------------------------------------------------------------------
    def agree(self, code: int, reason: str = "") -> Verdict:
        """The outcome of this point of a request, the same on every rank (see the module's docstring)."""
        if self.world == 1:  # no collective to lose step in
            return Verdict(FAILED if code == BROKEN else code, reason)
        if self.device is not None:
            self._collective(torch.cuda.synchronize, self.device)
        both = torch.tensor([code, -code], dtype=torch.int64)
        self._collective(dist.all_reduce, both, op=dist.ReduceOp.MAX, group=self.group)
        high, low = int(both[0]), -int(both[1])
        if high < STOPPED:
            if high == low:
                return Verdict(high)
            return Verdict(BROKEN, "the ranks lost step: some ended the request, others did not")
        mine = torch.zeros(2 + REASON_BYTES, dtype=torch.uint8)
        text = reason.encode()[:REASON_BYTES]
        mine[:2] = torch.tensor([code // 256, code % 256], dtype=torch.uint8)
        mine[2 : 2 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8) if text else mine[2:2]
        everyone = [torch.empty_like(mine) for _ in range(self.world)]
        self._collective(dist.all_gather, everyone, mine, group=self.group)
        said = []
        for rank, got in enumerate(everyone):
            got_code = int(got[0]) * 256 + int(got[1])
            words = got[2:].numpy().tobytes().rstrip(b"\0").decode(errors="replace")
            said.append((got_code, rank, words))
        return Verdict(high, _reason(high, said))

    def _collective(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # a rank died or stopped answering: nothing to agree with
            raise Broken(f"rank {self.rank} lost the other ranks ({_line(exc)})") from None


def _reason(high: int, said: list[tuple[int, int, str]]) -> str:
    """One line for the client: the highest code's reason; for a failure, which ranks it hit."""
    if high < FAILED:  # a stop or bad input: rank 0 and the others say the same
        return next(words for code, _, words in said if code == high)
    failed = [(code, rank, words) for code, rank, words in said if code >= FAILED]
    causes = [f"rank {rank}: {words}" for code, rank, words in failed if code != BROKEN] or [
        f"rank {rank}: {words}" for _, rank, words in failed
    ]
    line = "; ".join(causes)
    if high == BROKEN:
        line += "; the ranks are out of step and the server stops"
    return line


# --- test-only faults ---------------------------------------------------------------------------------

FAULTS_ENV = "ANATOMY_SERVER_FAULTS"
FAULT_KINDS = ("error", "oom", "mid")


@dataclass(frozen=True)
class Fault:
    """An exception this rank raises in its ``request``-th request (counted from 1 on this rank), at
    the start of ``block``: ``error`` (a RuntimeError) or ``oom`` (torch.OutOfMemoryError); or ``mid``:
    a RuntimeError inside the block, after its attention's collectives and before its FFN's. For the
    tests of the failure paths: a real exception on one rank, through the server's own code."""

    request: int
    block: int
    kind: str


def faults_from_env(rank: int) -> list[Fault]:
    """``ANATOMY_SERVER_FAULTS="RANK:REQUEST:BLOCK:KIND,..."``: this rank's faults."""
    text = os.environ.get(FAULTS_ENV, "")
    faults = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        parts = item.split(":")
        if len(parts) != 4 or not all(p.isascii() and p.isdigit() for p in parts[:3]) or parts[3] not in FAULT_KINDS:
            raise InputError(f"{FAULTS_ENV}: {item!r}: expected RANK:REQUEST:BLOCK:KIND, KIND one of {', '.join(FAULT_KINDS)}")
        if int(parts[0]) == rank:
            faults.append(Fault(int(parts[1]), int(parts[2]), parts[3]))
    if faults:
        log.warning("rank %d will fail on purpose (%s=%s)", rank, FAULTS_ENV, text)
    return faults


def fire(faults: list[Fault], request: int, block: int, kinds: tuple[str, ...]) -> None:
    """Raise the fault of this request and block, if one of ``kinds`` is listed."""
    for fault in faults:
        if (fault.request, fault.block) == (request, block) and fault.kind in kinds:
            message = f"injected fault in request {request} at block {block} ({FAULTS_ENV})"
            raise torch.OutOfMemoryError(message) if fault.kind == "oom" else RuntimeError(message)


LOAD_DELAY_ENV = "ANATOMY_SERVER_LOAD_DELAY"


def load_delay(rank: int) -> float:
    """``ANATOMY_SERVER_LOAD_DELAY="RANK:SECONDS"``: seconds this rank waits before loading (a slow
    disk, for the tests of the ranks' wait for the slowest load)."""
    who, _, seconds = os.environ.get(LOAD_DELAY_ENV, "").partition(":")
    if not who:
        return 0.0
    if not (who.isascii() and who.isdigit()) or not seconds.replace(".", "", 1).isdigit():
        raise InputError(f"{LOAD_DELAY_ENV}: expected RANK:SECONDS")
    return float(seconds) if int(who) == rank else 0.0
