"""Weight tiers for streaming: what the device and the host keep of a streamed model between passes.

A :class:`model.stream.Streamer` reads each unit (the embedding, a block without its routed experts,
one routed expert, the norm, the head, the MTP module) before it runs and frees it after. Given a
:class:`Tiers`, which outlives any one Streamer (``tracing.cli.loading.Loaded`` makes one per
process and hands it to every pass: a server's requests, a generation's decode steps, an atlas's
prompts), a unit it keeps is not read again:

- the **device tier** holds units as the model uses them (on the device, in the parameters'
  dtypes), up to ``device_budget`` bytes: every unit but the routed experts first (they run in
  every pass), then routed experts by recent use;
- the **host tier** holds units as they were read (the checkpoint's bytes, in pinned memory when
  the device is a GPU, so the copy to it can run beside the compute), up to ``host_budget``
  bytes: what the device tier evicts or cannot take;
- anything else is read from disk again.

On the CPU both tiers are host memory; they stay distinct (the device tier's tensors are used as
they are, the host tier's are copied and converted like a GPU's), so a CPU run takes every path.

Which unit makes room: a unit other than a routed expert may displace routed experts (oldest use
first); a routed expert displaces only experts that neither this pass nor the one before used. A
pass visits the blocks in order, so plain least-recently-used would evict, block by block, the
experts the same pass is about to need again (a repeated request would then read nearly
everything). With the rule, a request repeated reads exactly what the tiers did not hold after
the first, and a decode step keeps the experts the step before it used.

Each tier never holds more than its budget: a unit is admitted only after enough room was made,
and :attr:`Tier.peak` records the most it held.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    tensors: list[torch.Tensor]
    nbytes: int  # held, what the budget counts
    stored: int  # the checkpoint's bytes of the unit, what a pass's accounting counts
    expert: bool
    last_pass: int
    dtypes: tuple[torch.dtype, ...]  # the checkpoint's, for the host tier


class Tier:
    """One tier: units by name, least recently used first, within ``budget`` bytes."""

    def __init__(self, name: str, budget: int):
        self.name = name
        self.budget = max(int(budget), 0)
        self.held = 0
        self.peak = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        """The units held, least recently used first."""
        return list(self._entries)

    def stored_bytes(self, names: Sequence[str] | None = None) -> int:
        """The checkpoint's bytes of the units held (of ``names`` among them)."""
        chosen = self._entries if names is None else [n for n in names if n in self._entries]
        return sum(self._entries[n].stored for n in chosen)

    def _get(self, name: str, pass_no: int) -> _Entry | None:
        entry = self._entries.get(name)
        if entry is not None:
            entry.last_pass = pass_no
            self._entries.move_to_end(name)
        return entry

    def _pop(self, name: str) -> _Entry | None:
        entry = self._entries.pop(name, None)
        if entry is not None:
            self.held -= entry.nbytes
        return entry

    def _admit(self, name: str, entry: _Entry, pass_no: int) -> list[tuple[str, _Entry]] | None:
        """Hold ``entry`` if room can be made by the rule of the module's docstring; returns the
        units displaced for it, or None (and displaces nothing) when it is not admitted."""
        if name in self._entries or entry.nbytes > self.budget:
            return None
        need = self.held + entry.nbytes - self.budget
        victims = []
        if need > 0:
            for other, held in self._entries.items():  # least recently used first
                if not held.expert or (entry.expert and held.last_pass >= pass_no - 1):
                    continue
                victims.append(other)
                need -= held.nbytes
                if need <= 0:
                    break
            if need > 0:
                return None
        displaced = [(other, self._pop(other)) for other in victims]
        self._entries[name] = entry
        self.held += entry.nbytes
        self.peak = max(self.peak, self.held)
        return displaced

    def describe(self) -> dict[str, int]:
        return {"budget": self.budget, "held": self.held, "peak": self.peak, "units": len(self._entries)}


def _nbytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Tiers:
    """The device and host tiers of one streamed model on ``device`` (see the module's docstring).

    The :class:`~model.stream.Streamer` calls it from its reader threads: every method takes the
    lock. ``begin_pass`` is called before each forward pass: recent use is counted in passes."""

    def __init__(self, device: torch.device | str = "cpu", device_budget: int = 0, host_budget: int = 0):
        self.device = torch.device(device)
        self.device_tier = Tier("device", device_budget)
        self.host_tier = Tier("host", host_budget)
        self.passes = 0
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        """Whether the host tier's memory is page-locked (a GPU's copies from it run asynchronously)."""
        return self.device.type == "cuda"

    @property
    def keeps_raw(self) -> bool:
        """Whether a unit read from disk may go to the host tier (so a GPU reads it into pinned memory)."""
        return self.host_tier.budget > 0

    def begin_pass(self) -> int:
        with self._lock:
            self.passes += 1
            return self.passes

    def lookup(self, name: str) -> tuple[str, list[torch.Tensor]] | None:
        """("device", the tensors to use) or ("host", the tensors as read, to copy), or None."""
        with self._lock:
            entry = self.device_tier._get(name, self.passes)
            if entry is not None:
                return "device", entry.tensors
            entry = self.host_tier._get(name, self.passes)
            if entry is not None:
                return "host", entry.tensors
        return None

    def holds(self, name: str) -> bool:
        with self._lock:
            return name in self.device_tier or name in self.host_tier

    def offer(
        self,
        name: str,
        used: list[torch.Tensor],
        raw: list[torch.Tensor] | None,
        stored: int,
        expert: bool,
        dtypes: Sequence[torch.dtype],
    ) -> str | None:
        """A unit just read (``raw``: its tensors as read, on the host; None when read straight to
        the device) or copied from the host tier, and ``used``, the tensors the model uses. The
        device tier takes ``used`` if it can (a unit from the host tier then leaves it); else the
        host tier takes ``raw``. What the device tier displaces goes to the host tier, copied
        back to the host in the checkpoint's ``dtypes``. Returns the tier that holds the unit now,
        or None."""
        dtypes = tuple(dtypes)
        with self._lock:
            p = self.passes
            displaced = self.device_tier._admit(name, _Entry(used, _nbytes(used), stored, expert, p, dtypes), p)
            if displaced is not None:
                self.host_tier._pop(name)
                for other, entry in displaced:
                    self._to_host(other, entry)
                return "device"
            if name in self.host_tier:
                return "host"
            if raw is not None:
                entry = _Entry(raw, _nbytes(raw), stored, expert, p, dtypes)
                if self.host_tier._admit(name, entry, p) is not None:
                    return "host"
        return None

    def _to_host(self, name: str, entry: _Entry) -> None:
        """A unit the device tier let go, to the host tier if it takes it (pinned on a GPU)."""
        if self.host_tier.budget < entry.stored:
            return
        if self.pinned:
            raw = [t.to("cpu", dtype).pin_memory() for t, dtype in zip(entry.tensors, entry.dtypes, strict=True)]
        else:
            raw = [t.to(dtype) for t, dtype in zip(entry.tensors, entry.dtypes, strict=True)]
        kept = _Entry(raw, _nbytes(raw), entry.stored, entry.expert, entry.last_pass, entry.dtypes)
        self.host_tier._admit(name, kept, self.passes)

    def clear(self) -> None:
        """Drop every unit held (their memory goes when the model is done with it)."""
        with self._lock:
            for tier in (self.device_tier, self.host_tier):
                for name in tier.names():
                    tier._pop(name)

    def describe(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {"device": self.device_tier.describe(), "host": self.host_tier.describe()}


__all__ = ["Tier", "Tiers"]
