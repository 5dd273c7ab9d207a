"""The atlas: the router and the sparse attention counted over a whole corpus, not one prompt.

``python -m tracing atlas`` (tracing.cli.atlas) and the Python API::

    job = AtlasJob(sources, tokenizer, model_args, "atlas-out", seq_len=256, batch_size=8)  # checks, counts
    summary = job.run(loaded)                                      # tracing.cli.loading.open_checkpoint(...)
    atlas = read_atlas("atlas-out")                                # atlas.tables[...], atlas.summary

The corpus (tracing.atlas.corpus) runs through the model in batches; hooks (tracing.atlas.counts) count
each batch as it is produced and keep nothing else. Every ``checkpoint_every`` seconds the totals
are written atomically to ``atlas_state.safetensors`` in the output directory with the number of
batches done; ``resume`` continues after them, so a batch is never counted twice (the batches come
in a fixed order). At the end the tables (``<table>.parquet``, columns in
tracing.atlas.tables.COLUMNS) and ``summary.json`` are written together, or not at all.

Under ``torchrun`` the ranks share the work as the model was opened: whole on every rank (data
parallel, ``split=False`` in tracing.cli.loading), batch ``b`` of each round of ``world`` batches runs
on rank ``b mod world`` and the totals are added into rank 0's at every checkpoint; split over
the ranks (tensor and expert parallel), every rank runs every batch. Rank 0 writes.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
import torch.distributed as dist

from model import fp8
from model.config import ModelArgs

from ..analyses.interventions import applied
from ..cli.inputs import parse_float, parse_int
from ..cli.output import Outputs, check_directory, write_file
from ..cli.progress import ProgressBar
from ..errors import InputError
from .corpus import Corpus, Source
from .counts import FIXED, RECALL_BINS, AtlasCounts, check_state
from .tables import COLUMNS, OPTIONAL, imbalance, tables

FORMAT = "deepseek-v32-atlas"
VERSION = 1
STATE = "atlas_state.safetensors"
SUMMARY = "summary.json"
DEFAULT_SEQ_LEN = 512
FILES = (*(f"{name}.parquet" for name in COLUMNS), SUMMARY, STATE)


class AtlasError(InputError):
    """An atlas directory or checkpoint that cannot be read, or one of another run."""


@dataclass
class Atlas:
    """An atlas directory read back: its tables (name -> DataFrame) and summary.json."""

    tables: dict[str, pd.DataFrame]
    summary: dict
    path: Path | None = None


def read_atlas(path: str | os.PathLike) -> Atlas:
    """Every table and the summary of an atlas directory, read whole (the files may go away after)."""
    path = Path(path)
    if not path.is_dir():
        raise AtlasError(f"{path}: not a directory")
    try:
        summary = json.loads((path / SUMMARY).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AtlasError(f"{path}: no {SUMMARY}: not an atlas directory, or its run has not finished") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise AtlasError(f"{path / SUMMARY}: not readable JSON ({exc})") from None
    if not isinstance(summary, dict) or summary.get("format") != FORMAT:
        raise AtlasError(f"{path / SUMMARY}: not the summary of an atlas (format {FORMAT!r})")
    found = {}
    for name, columns in COLUMNS.items():
        file = path / f"{name}.parquet"
        try:
            frame = pd.read_parquet(file)
        except FileNotFoundError:
            if name in OPTIONAL:  # an atlas of an earlier version: `--resume` on its checkpoint writes it
                continue
            raise AtlasError(f"{path}: {file.name} is missing") from None
        except Exception as exc:  # pyarrow raises its own error types for damaged files
            raise AtlasError(f"{file}: not a readable Parquet table ({type(exc).__name__}: {exc})") from None
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise AtlasError(f"{file}: no column {missing[0]!r}; not an atlas table of this version")
        found[name] = frame
    return Atlas(found, summary, path)


def shard_fingerprint(directory: str | os.PathLike) -> list[list]:
    """The checkpoint's weight files by name, size and modification time: a resumed run must count
    with the weights it started with, and weights replaced in place keep the directory's name."""
    directory = Path(directory)
    try:
        files = sorted(p for p in directory.iterdir() if p.name.endswith(".safetensors"))
        return [[p.name, (st := p.stat()).st_size, st.st_mtime_ns] for p in files]
    except OSError as exc:
        raise AtlasError(f"{directory}: cannot list the weight files ({exc.strerror or exc})") from None


def _check_ours(out: Path) -> None:
    """Writing an atlas replaces its files (summary.json, the Parquet tables): refuse a directory
    that holds files and is not an atlas, whose own files of those names would be lost."""
    try:
        entries = [name for name in os.listdir(out) if not (name.startswith(".") and name.endswith(".tmp"))]
    except (FileNotFoundError, NotADirectoryError):
        return
    except OSError as exc:
        raise AtlasError(f"{out}: cannot list the directory ({exc.strerror or exc})") from None
    if entries and not _is_atlas(out):
        raise AtlasError(f"{out}: holds files and is not an atlas directory; refusing to write into it (give a new or empty one)")


def _is_atlas(out: Path) -> bool:
    """A finished atlas (its summary.json) or one under way (its checkpoint), of this format."""
    from safetensors import SafetensorError, safe_open

    summary, state = out / SUMMARY, out / STATE
    try:
        if summary.is_file() and summary.stat().st_size < 1 << 24:
            data = json.loads(summary.read_text(encoding="utf-8"))
            if isinstance(data, dict) and data.get("format") == FORMAT:
                return True
        if state.is_file():
            with safe_open(str(state), framework="pt") as f:
                return (f.metadata() or {}).get("format") == f"{FORMAT}-state"
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, SafetensorError):
        return False
    return False


def _ranks() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


@dataclass
class AtlasJob:
    """One atlas run, checked and counted before any model loads: the texts (every input read
    once, see tracing.atlas.corpus), the settings against ``args`` (the model's config), the output
    directory and, with ``resume``, its checkpoint. :meth:`run` then runs the model."""

    sources: list[Source]
    tokenizer: object
    args: ModelArgs
    out: str | os.PathLike
    seq_len: int | None = None
    batch_size: int = 4
    max_tokens: int | None = None
    min_count: int = 5
    label: str = ""
    resume: bool = False
    leaders: object = None  # with the model split per node: the group of each replica's first rank
    weights: list | None = None  # the checkpoint's weight files (shard_fingerprint); None: synthetic weights
    interventions: tuple = ()  # tracing.analyses.interventions, applied to every batch (the counts see what the model used)
    done: int = field(default=0, init=False)  # batches counted by the checkpoint resumed

    def __post_init__(self):
        self.out = check_directory(self.out)
        _check_ours(self.out)
        limit = self.args.max_seq_len
        if self.seq_len is None:
            self.seq_len = min(DEFAULT_SEQ_LEN, limit)
        if self.seq_len > limit:
            raise InputError(f"--seq-len {self.seq_len}: this model takes at most {limit} positions")
        if self.min_count < 1:
            raise InputError(f"--min-count {self.min_count}: must be at least 1")
        if self.tokenizer is None:
            raise InputError("the atlas reads text: it needs the checkpoint's tokenizer.json")
        if self.tokenizer.vocab_size > self.args.vocab_size:
            raise InputError(
                f"the tokenizer has {self.tokenizer.vocab_size} tokens, the model's vocabulary {self.args.vocab_size}"
            )
        self.corpus = Corpus(self.sources, self.tokenizer, self.seq_len, self.batch_size, self.max_tokens)
        self.survey = self.corpus.survey()
        config = json.dumps(self.args.to_reference(), sort_keys=True).encode()
        self.fingerprint = {
            "checkpoint": self.label,
            "config_sha256": hashlib.sha256(config).hexdigest(),
            "inputs": [[i["sha256"], i.get("field")] for i in self.survey.inputs],
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "max_tokens": self.max_tokens,
            "weights": self.weights,
            **({"interventions": [i.describe() for i in self.interventions]} if self.interventions else {}),
            **({"fp8_sums": fp8.INEXACT_SUMS} if fp8.sums_inexactly() else {}),
        }
        self._state: dict[str, torch.Tensor] | None = None
        self._seconds = 0.0
        if _ranks()[0] == 0 and (self.out / STATE).exists():
            if self.resume:
                self._read_state()
            else:
                print(
                    f"note: {self.out} holds the checkpoint of an earlier run; starting anew (--resume continues it)",
                    file=sys.stderr,
                )
        elif self.resume and _ranks()[0] == 0:
            print(f"note: {self.out} holds no checkpoint ({STATE}): starting from the beginning", file=sys.stderr)

    # checkpoints --------------------------------------------------------------------------------------
    def _read_state(self) -> None:
        from safetensors import SafetensorError, safe_open

        path = self.out / STATE
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                state = {name: f.get_tensor(name) for name in f.keys()}
            run = json.loads(meta["run"])
            done, seconds = parse_int(meta["done_batches"], "done_batches"), parse_float(meta["seconds"], "seconds")
            if not isinstance(run, dict):
                raise ValueError("no description of its run")
        except (SafetensorError, OSError, ValueError, KeyError, RecursionError) as exc:
            raise AtlasError(f"{path}: not a readable atlas checkpoint ({exc})") from None
        for key, want in self.fingerprint.items():
            if run.get(key) != want:
                what = {"inputs": "the texts differ", "weights": "the checkpoint's weight files changed since"}.get(key)
                what = what or f"{key} {run.get(key)!r} there, {want!r} here"
                raise AtlasError(f"--resume: {path} is the checkpoint of another run ({what})")
        if not 0 <= done <= self.survey.batches or seconds < 0:
            raise AtlasError(f"{path}: {done} batches done of {self.survey.batches} in {seconds} s")
        check_state(state, self.args, self.seq_len, str(path))
        self._state, self.done, self._seconds = state, done, seconds

    def _state_bytes(self, state: dict[str, torch.Tensor], done: int, seconds: float) -> bytes:
        from safetensors.torch import save

        meta = {
            "format": f"{FORMAT}-state",
            "run": json.dumps(self.fingerprint),
            "done_batches": str(done),
            "seconds": repr(seconds),
        }
        return save(state, metadata=meta)

    # the run --------------------------------------------------------------------------------------------
    def run(
        self,
        loaded,
        checkpoint_every: float = 300.0,
        progress: bool = False,
        on_round: Callable[[int], None] | None = None,
    ) -> dict:
        """Run every batch not yet counted through ``loaded`` (tracing.cli.loading.Loaded) and write the
        atlas; returns its summary. ``on_round(done)`` is called after each round's checkpoint
        decision with the number of batches counted so far."""
        model, device = loaded.model, loaded.device
        rank, world = _ranks()
        # the replicas of the model share the batches: every rank holding the whole model is one (data
        # parallel), a group of ranks holding it split is one (model parallel: one group, or one per node)
        per_replica = 1 if loaded.plan is None else loaded.plan.world
        stride, mine = world // per_replica, rank // per_replica
        leader = rank % per_replica == 0  # its replica's first rank: the one whose counts are added
        counts = AtlasCounts(self.args, self.seq_len, device, plan=loaded.plan)
        if rank == 0 and self._state is not None:
            counts.load(self._state, str(self.out / STATE))
            self._state = None
        done = self._agree(self.done, device)
        total = self.survey.batches
        bar = ProgressBar(total, enabled=progress and rank == 0)
        started = time.perf_counter()
        last_checkpoint, session_tokens, counted = started, 0, 0
        # the interventions' hooks first: the counts' hooks then read the values the model uses
        with applied(model, self.interventions), counts.watch(model), torch.inference_mode(), loaded.context() or nullcontext():
            for index, batch in enumerate(self.corpus.batches()):
                counted += len(batch) * len(batch[0])
                if index < done:
                    continue
                if (index - done) % stride == mine:
                    ids = torch.tensor(batch, dtype=torch.long, device=device)  # (B, T)
                    counts.begin(ids)
                    model(ids)
                    counts.commit()
                session_tokens += len(batch) * len(batch[0])
                if (index - done) % stride != stride - 1 and index != total - 1:
                    continue  # the round goes on
                now = time.perf_counter()
                last = index == total - 1
                due = self._agree(int(last or now - last_checkpoint >= checkpoint_every), device)
                if due and stride > 1:
                    if leader:  # the replicas' counts into rank 0's; a replica's other ranks hold copies
                        counts.reduce_to_first_rank(self.leaders if per_replica > 1 else None)
                    else:
                        counts.forget()
                if due and not last and rank == 0:
                    state = self._state_bytes(counts.state(), index + 1, self._seconds + now - started)
                    write_file(self.out / STATE, state)
                    last_checkpoint = now
                rate = session_tokens / max(now - started, 1e-9)
                eta = _duration((self.survey.tokens - counted) / rate) if rate else "?"
                bar.update(index + 1, f"{counted:,} tokens  {rate:,.0f} tokens/s  ETA {eta}")
                if on_round is not None:
                    on_round(index + 1)
        bar.close()
        seconds = self._seconds + time.perf_counter() - started
        if rank != 0:
            return {}
        return self._write(counts, loaded, seconds, done, world)

    def _agree(self, value: int, device: torch.device) -> int:
        """Rank 0's ``value`` on every rank (one small broadcast; none in one process)."""
        if _ranks()[1] == 1:
            return value
        flag = torch.tensor([value], dtype=torch.int64, device=device)
        dist.broadcast(flag, src=0)
        return int(flag.item())

    def _write(self, counts: AtlasCounts, loaded, seconds: float, resumed: int, world: int) -> dict:
        state = counts.state()
        names = self.tokenizer.token_strings
        found = tables(state, self.args, names, self.min_count)
        tokens = int(state["tokens"][0])
        summary = {
            "format": FORMAT,
            "version": VERSION,
            "checkpoint": self.label or loaded.label,
            "config": self.args.to_reference(),
            "texts": self.survey.inputs,
            "sequences": int(state["sequences"][0]),
            "tokens": tokens,
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
            "settings": {
                "seq_len": self.seq_len,
                "batch_size": self.batch_size,
                "max_tokens": self.max_tokens,
                "min_count": self.min_count,
                "device": str(loaded.device),
                "dtype": str(loaded.model.dtype).removeprefix("torch."),
                "stream": loaded.stream,
                "parallel": _layout(loaded, world),
                "world_size": world,
                "interventions": [i.describe() for i in self.interventions],
                "batches": self.survey.batches,
            },
            "resumed_after_batches": resumed,
            "n_layers": self.args.n_layers,
            "moe_blocks": list(range(self.args.n_dense_layers, self.args.n_layers)),
            "n_routed_experts": self.args.n_routed_experts,
            "n_activated_experts": self.args.n_activated_experts,
            "n_expert_groups": self.args.n_expert_groups,
            "index_topk": self.args.index_topk,
            "imbalance": imbalance(found["expert_load"]),
            "recall_bins": RECALL_BINS,
            "fixed_point_unit": 1 / FIXED,
            "tables": {name: list(columns) for name, columns in COLUMNS.items()},
        }
        summary = _finite(summary)
        state_bytes = self._state_bytes(state, self.survey.batches, seconds)
        with Outputs() as out:  # the tables, the summary and the final checkpoint land together
            folder = out.directory(self.out, stale=FILES)
            for name, frame in found.items():
                folder.write(f"{name}.parquet", lambda path, frame=frame: frame.to_parquet(path, index=False))
            text = json.dumps(summary, indent=1, allow_nan=False) + "\n"
            folder.write(SUMMARY, lambda path: path.write_text(text, encoding="utf-8"))
            folder.write(STATE, lambda path: path.write_bytes(state_bytes))
        return summary


def _finite(value):
    """JSON has no NaN: None instead."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _layout(loaded, world: int) -> str:
    """How the ranks shared the work: none, data, model, or model x data (the model split per group)."""
    if loaded.plan is not None:
        replicas = world // loaded.plan.world
        return "model" if replicas == 1 else f"model x data ({loaded.plan.world} x {replicas})"
    return "data" if world > 1 else "none"


def build_atlas(loaded, sources: list[Source], out: str | os.PathLike, **settings) -> dict:
    """Check the texts, run them through ``loaded`` and write the atlas into ``out``; returns the
    summary. ``settings``: AtlasJob's (seq_len, batch_size, max_tokens, min_count, resume) and
    run's (checkpoint_every, progress, on_round)."""
    run_keys = ("checkpoint_every", "progress", "on_round")
    run = {k: settings.pop(k) for k in run_keys if k in settings}
    directory = getattr(loaded.source, "directory", None)  # a checkpoint's (SafetensorsSource); synthetic weights have none
    settings.setdefault("weights", shard_fingerprint(directory) if directory is not None else None)
    job = AtlasJob(sources, settings.pop("tokenizer", loaded.tokenizer), loaded.model.args, out, label=loaded.label, **settings)
    return job.run(loaded, **run)
