"""A one-line progress bar on stderr for long runs (blocks done, bytes read, throughput)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``update(done, nbytes)``; draws only on a terminal unless ``force``."""

    def __init__(self, total: int, label: str = "block", stream: TextIO | None = None, force: bool = False):
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.enabled = force or self.stream.isatty()
        self.started = time.perf_counter()
        self.nbytes = 0

    def update(self, done: int, nbytes: int = 0) -> None:
        self.nbytes += nbytes
        if not self.enabled:
            return
        width = 30
        filled = int(width * done / max(self.total, 1))
        elapsed = time.perf_counter() - self.started
        text = f"\r[{'#' * filled}{'.' * (width - filled)}] {self.label} {done}/{self.total}  {elapsed:6.1f}s"
        if self.nbytes:
            text += f"  {self.nbytes / 2**30:.2f} GiB read, {self.nbytes / 2**20 / max(elapsed, 1e-9):.0f} MiB/s"
        self.stream.write(text)
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
