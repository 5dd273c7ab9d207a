"""The one progress bar of long runs, on stderr: a traced forward's blocks, a streamed model's steps,
an atlas's batches. The command line and the scripts draw it; model.stream reports through a
callback (:func:`stream_bar` makes one)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from model.stream import ProgressFn, StreamEvent


class ProgressBar:
    """``[########................] 2/6 layers.1      0.31 GB    1.20 GB/s      0.3 s``, redrawn in place.

    The caller decides ``enabled``: a redrawn line belongs on a terminal, not in a log or in the
    output of every rank. Bytes and throughput are shown when an update gives ``bytes_read``.
    """

    def __init__(self, total: int, out: TextIO | None = None, *, enabled: bool = True, width: int = 24):
        self.total = total
        self.out = out or sys.stderr
        self.enabled = enabled
        self.width = width
        self.started = time.perf_counter()
        self._drawn = False  # a line is open: close() ends it

    def update(self, done: int, name: str = "", bytes_read: int | None = None, seconds: float | None = None) -> None:
        """Draw ``done`` of ``total``; ``seconds`` since the start (default: since this bar was made)."""
        if not self.enabled:
            return
        if seconds is None:
            seconds = time.perf_counter() - self.started
        filled = round(self.width * done / max(self.total, 1))
        line = f"\r[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} {name:<10}"
        if bytes_read is not None:
            gbps = bytes_read / seconds / 1e9 if seconds > 0 else 0.0
            line += f" {bytes_read / 1e9:8.2f} GB  {gbps:6.2f} GB/s"
        self.out.write(f"{line}  {seconds:7.1f} s")
        self.out.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line, so what is printed next starts on its own."""
        if self._drawn:
            self.out.write("\n")
            self.out.flush()
            self._drawn = False


def stream_bar(out: TextIO | None = None, width: int = 24) -> ProgressFn:
    """A streamed forward's steps on the bar (model.stream's progress callback): step, bytes read,
    throughput, elapsed; one line per forward."""
    bar = ProgressBar(0, out, width=width)

    def show(e: StreamEvent) -> None:
        bar.total = e.total
        bar.update(e.step, e.name, e.bytes_read, e.seconds)
        if e.step == e.total:
            bar.close()

    return show
