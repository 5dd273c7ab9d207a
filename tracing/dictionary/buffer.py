"""The activation buffer: rows of a site's values on disk, in safetensors chunks, read back shuffled.

Training gathers activations a corpus batch at a time; they are appended here and written out in
chunks of ``chunk_rows`` rows (``chunk-NNNNN.safetensors`` in the buffer's directory) until the
chunks reach ``max_bytes``. The trainer then reads the buffer back in random order (the chunks
shuffled, then ``mix`` chunks at a time concatenated and their rows shuffled), so a training batch
draws from several corpus batches, not one sequence's neighbouring positions. Memory holds the
unwritten chunk and the ``mix`` chunks being read, never the buffer: the real model's 7168-wide
stream costs 28 KB a position, and a buffer of millions of positions lives on disk only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import InputError

CHUNK_GLOB = "chunk-*.safetensors"


class ActivationBuffer:
    """Rows ``x`` (N, d_in) and, for a transcoder, their targets ``y`` (N, d_out), float32."""

    def __init__(self, directory: str | Path, d_in: int, d_out: int | None, max_bytes: int, chunk_bytes: int | None = None):
        self.directory = Path(directory)
        self.d_in, self.d_out = d_in, d_out
        self.row_bytes = 4 * (d_in + (d_out or 0))
        if max_bytes < self.row_bytes:
            raise InputError(f"a buffer of {max_bytes:,} bytes holds no row of {self.row_bytes:,} bytes")
        self.max_bytes = max_bytes
        chunk_bytes = chunk_bytes or min(max(max_bytes // 16, 1 << 16), 64 << 20)
        self.chunk_rows = max(1, min(chunk_bytes, max_bytes) // self.row_bytes)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.clear()
        self.peak_bytes = 0  # the most bytes of rows held in memory at once (unwritten, or being read)

    @property
    def rows(self) -> int:
        """Rows written to disk and pending."""
        return self._written + sum(len(x) for x in self._pending_x)

    @property
    def bytes_on_disk(self) -> int:
        return self._written * self.row_bytes

    @property
    def full(self) -> bool:
        return self.rows * self.row_bytes >= self.max_bytes

    def add(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """Append rows (N, d_in) [and (N, d_out)]; a chunk is written whenever ``chunk_rows`` are pending."""
        self._pending_x.append(x.detach().float().cpu())
        if self.d_out is not None:
            self._pending_y.append(y.detach().float().cpu())
        self._note(self._pending_rows() * self.row_bytes)
        while self._pending_rows() >= self.chunk_rows:
            self._write(self.chunk_rows)

    def flush(self) -> None:
        """Write what is pending (a last, shorter chunk)."""
        if self._pending_rows():
            self._write(self._pending_rows())

    def batches(self, batch_size: int, generator: torch.Generator, mix: int = 2) -> Iterator[tuple[torch.Tensor, ...]]:
        """Every row once, in batches of ``batch_size`` (the last may be shorter), shuffled: (x,) or (x, y)."""
        self.flush()
        order = torch.randperm(len(self._chunks), generator=generator).tolist()
        carry: list[torch.Tensor] | None = None
        for start in range(0, len(order), mix):
            parts = [load_file(self._chunks[i]) for i in order[start : start + mix]]
            names = ("x",) if self.d_out is None else ("x", "y")
            block = [torch.cat([p[n] for p in parts]) for n in names]
            if carry is not None:
                block = [torch.cat([c, b]) for c, b in zip(carry, block, strict=True)]
            self._note(len(block[0]) * self.row_bytes)
            perm = torch.randperm(len(block[0]), generator=generator)
            block = [b[perm] for b in block]
            whole = len(block[0]) // batch_size * batch_size
            for i in range(0, whole, batch_size):
                yield tuple(b[i : i + batch_size] for b in block)
            carry = [b[whole:] for b in block]
        if carry is not None and len(carry[0]):
            yield tuple(carry)

    def clear(self) -> None:
        """Remove every chunk (and anything pending)."""
        for path in self.directory.glob(CHUNK_GLOB):
            path.unlink()
        self._chunks: list[Path] = []
        self._written = 0
        self._pending_x: list[torch.Tensor] = []
        self._pending_y: list[torch.Tensor] = []

    def _pending_rows(self) -> int:
        return sum(len(x) for x in self._pending_x)

    def _write(self, n: int) -> None:
        x = torch.cat(self._pending_x)
        tensors = {"x": x[:n].contiguous()}
        rest = [x[n:]]
        if self.d_out is not None:
            y = torch.cat(self._pending_y)
            tensors["y"] = y[:n].contiguous()
            self._pending_y = [y[n:]]
        path = self.directory / f"chunk-{len(self._chunks):05d}.safetensors"
        save_file(tensors, path)
        self._chunks.append(path)
        self._written += n
        self._pending_x = rest

    def _note(self, nbytes: int) -> None:
        self.peak_bytes = max(self.peak_bytes, nbytes)
