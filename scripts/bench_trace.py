"""What tracing costs: forward time untraced, with hooks that do nothing, traced with the default
sites and with everything, as ratios measured in one process; and the time of the CSV export.

    python scripts/bench_trace.py                       # the demo checkpoint (assets/demo), T = 128
    python scripts/bench_trace.py --checkpoint DIR --reps 30

A benchmark run by hand, not a test; it prints one JSON object on stdout (progress on stderr).

Variants, each timed per round in an order rotated from round to round (one warm-up first), so
background load falls on all alike; ``ratio`` is the median over rounds of variant time / the
same round's untraced time (``cpu_ratio``: the same over this process's CPU time, which the other
processes' load stretches less than wall time):

* ``untraced``            ``model(batch)`` under inference_mode.
* ``untraced_mtp``        ``model(batch, mtp=True)``: the forward with the MTP module's draft (a checkpoint
  with one), the work the default ``mtp.topk_*`` sites make the model do; ``vs_mtp`` in a traced
  variant's results is its time over this one's, round by round: tracing's own cost with the draft
  counted as the model's.
* ``tracer_empty``        ``with Tracer(model, record=[]): model(batch)`` -- a Tracer that records
  nothing (it registers no hooks at all: ``hooks`` says how many).
* ``noop_hooks``          ``model(batch)`` with a forward hook that returns None on every hook point but
  the MTP module's (registered and removed outside the timed region): hooks present but not
  recording (a hook on ``mtp.0.logits`` would run the MTP module).
* ``tracer_default``      ``with Tracer(model): model(batch)``: the default sites recorded to CPU.
* ``trace_default``       ``trace_tokens(model, ids)``: what ``python -m tracing run`` does (Tracer,
  logit lens, the Trace object).
* ``trace_all``           ``trace_tokens(model, ids, record="all")``.
* ``trace_default_no_mtp``  the default sites without ``mtp.*``: what the default costs without the
  MTP module's draft (a model without one records the same).
* ``trace_default_no_next``  the default sites without ``mtp.*`` and ``next.*``: a diagnostic, what
  the head at every position (``next.*``: logits, log-softmax, entropy) adds.

With ``--old-tree DIR`` (a checkout of the tree before a change, e.g. ``git worktree add DIR HEAD``),
its ``tracing`` package is imported beside this one as ``tracing_old`` (the same ``model``) and
``old_tracer_default``, ``old_trace_default`` and ``old_trace_default_no_mtp`` are timed in the
same rounds: before and after in one run.

Targets (issue 3): trace_default within 1.15x of untraced; hooks present but not recording
(noop_hooks) within 1.02x; ``tracing.tables.export`` of all tables of the trace under 2 s (timed
for the default trace, the one the target names, and for the record='all' trace).

If the checkpoint cannot be opened, a synthetic model of the demo's architecture
(assets/demo/config.json) is used instead, and the JSON says so.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# First: torch's idle OpenMP threads sleep (tracing.startup). With libgomp's spinning, on a 2-core machine with a
# training job on the other core, 2 threads ran the demo's forward ~100x slower than 1 thread and the numbers
# measured scheduler luck; set OMP_WAIT_POLICY=ACTIVE yourself to see the default.
from tracing.startup import load_torch  # noqa: E402

load_torch()

from model import ModelArgs  # noqa: E402

# isort: split
import torch  # noqa: E402

from model.checkpoint import load_model  # noqa: E402
from model.synthetic import SyntheticSource  # noqa: E402
from tracing import tables  # noqa: E402
from tracing.cli.loading import DEMO, open_checkpoint  # noqa: E402
from tracing.runner import trace_tokens  # noqa: E402
from tracing.sites import DEFAULT_PATTERNS, hook_points  # noqa: E402
from tracing.tracer import Tracer  # noqa: E402

THREADS = 2
SEED = 0
TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. The Python interpreter reads a program, compiles it to bytecode and runs it on a virtual machine; "
    "functions, classes and modules are objects like any other. "
)


def log(msg: str) -> None:
    print(f"[bench_trace {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def open_model(checkpoint: str, dtype: torch.dtype, n_tokens: int) -> tuple[torch.nn.Module, list[int], dict]:
    """The model, the prompt's token ids (exactly n_tokens) and a description of what was used."""
    try:
        loaded = open_checkpoint(checkpoint, dtype=dtype)
    except Exception as exc:  # a missing / half-written checkpoint: fall back, and say so
        args = ModelArgs.from_file(DEMO / "config.json")
        model = load_model(SyntheticSource(args, seed=SEED), dtype=dtype)
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, args.vocab_size, (n_tokens,), generator=gen).tolist()
        info = {
            "model": "synthetic fallback",
            "why": f"--checkpoint {checkpoint!r} could not be opened: {type(exc).__name__}: {exc}",
            "architecture": "assets/demo/config.json",
            "note": "random weights of the demo's architecture (not the trained demo): routing and index scores are "
            "not a trained model's, but the trace's sizes and the work per site are the same",
            "prompt": f"{n_tokens} random token ids",
        }
        return model, ids, info
    model = loaded.model
    info = {"model": loaded.label, "checkpoint": str(checkpoint)}
    if loaded.tokenizer is not None:
        ids = loaded.tokenizer.encode(TEXT * (1 + n_tokens // 20))[:n_tokens]
        info["prompt"] = f"the first {n_tokens} tokens of an English text (Austen, then Python docs prose)"
    else:
        gen = torch.Generator().manual_seed(SEED)
        ids = torch.randint(0, model.args.vocab_size, (n_tokens,), generator=gen).tolist()
        info["prompt"] = f"{n_tokens} random token ids (the checkpoint has no tokenizer)"
    return model, ids, info


def _ratios(times: list[float], base: list[float]) -> list[float]:
    return [t / u for t, u in zip(times, base, strict=True)]


def noop_hook(module, inputs, output):
    return None


def old_tracing(tree: Path):
    """The tracing package of another checkout, imported as ``tracing_old`` (the model is this tree's)."""
    spec = importlib.util.spec_from_file_location(
        "tracing_old", tree / "tracing" / "__init__.py", submodule_search_locations=[str(tree / "tracing")]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules["tracing_old"] = package
    spec.loader.exec_module(package)
    return importlib.import_module("tracing_old.tracer").Tracer, importlib.import_module("tracing_old.runner").trace_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="demo", help="checkpoint directory, or 'demo' (default)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--reps", type=int, default=25, help="timed rounds (default 25)")
    parser.add_argument("--export-reps", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=180.0, help="stop adding rounds after this many seconds")
    parser.add_argument("--threads", type=int, default=THREADS, help=f"torch threads (default {THREADS}: this machine's cores)")
    parser.add_argument("--old-tree", type=Path, help="also time the tracing package of this checkout (the tree before a change)")
    opts = parser.parse_args()

    torch.set_num_threads(opts.threads)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[opts.dtype]
    wall = time.perf_counter()
    load_start = load_average()
    model, ids, info = open_model(opts.checkpoint, dtype, opts.tokens)
    log(f"model: {info['model']}")
    batch = torch.tensor([ids], dtype=torch.long)
    points = {name: p for name, p in hook_points(model).items() if not name.startswith("mtp.")}
    no_lens = [p for p in DEFAULT_PATTERNS if ".logit_lens." not in p]
    no_mtp = [p for p in DEFAULT_PATTERNS if not p.startswith("mtp.")]
    no_next = [p for p in no_mtp if not p.startswith("next.")]
    drafts = bool(model.mtp)

    def untraced():
        with torch.inference_mode():
            model(batch)

    def untraced_mtp():
        with torch.inference_mode():
            model(batch, mtp=drafts)

    def tracer_empty():
        with torch.inference_mode(), Tracer(model, []) as tracer:
            model(batch)
            tracer_empty.hooks = len(tracer._hooks._handles)

    def tracer_default():
        with torch.inference_mode(), Tracer(model) as tracer:
            model(batch)
            tracer_default.hooks = len(tracer._hooks._handles)

    def trace_default():
        return trace_tokens(model, ids)

    def trace_all():
        return trace_tokens(model, ids, record="all")

    def trace_default_minus_logit_lens():  # diagnostic: what the default costs without the logit lens
        return trace_tokens(model, ids, record=no_lens)

    def trace_default_no_mtp():
        return trace_tokens(model, ids, record=no_mtp)

    def trace_default_no_next():
        return trace_tokens(model, ids, record=no_next)

    variants = {
        "untraced": untraced,
        "untraced_mtp": untraced_mtp,
        "tracer_empty": tracer_empty,
        "noop_hooks": untraced,  # the same call, timed while no-op hooks sit on every hook point
        "tracer_default": tracer_default,
        "trace_default": trace_default,
        "trace_all": trace_all,
        "trace_default_minus_logit_lens": trace_default_minus_logit_lens,
        "trace_default_no_mtp": trace_default_no_mtp,
        "trace_default_no_next": trace_default_no_next,
    }
    if opts.old_tree:
        OldTracer, old_trace_tokens = old_tracing(opts.old_tree)

        def old_tracer_default():
            with torch.inference_mode(), OldTracer(model):
                model(batch)

        variants["old_tracer_default"] = old_tracer_default
        variants["old_trace_default"] = lambda: old_trace_tokens(model, ids)
        variants["old_trace_default_no_mtp"] = lambda: old_trace_tokens(model, ids, record=no_mtp)
    names = list(variants)
    times: dict[str, list[float]] = {n: [] for n in names}
    cpu_times: dict[str, list[float]] = {n: [] for n in names}  # this process's CPU time: less of the others' load
    handles: list = []

    def run(name: str) -> float:
        if name == "noop_hooks":
            handles.extend(p.register_forward_hook(noop_hook) for p in points.values())
        try:
            start, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            cpu_times[name].append(time.process_time() - cpu)
            return time.perf_counter() - start
        finally:
            for h in handles:
                h.remove()
            handles.clear()

    for name in names:  # warm-up (the FP8 weight caches are built on the first forward)
        run(name)
    log(f"timing up to {opts.reps} rounds of {len(names)} variants, T={len(ids)}")
    started = time.perf_counter()
    rounds = 0
    for r in range(opts.reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(run(name))
        rounds += 1
        if time.perf_counter() - started > opts.budget_s and rounds >= 5:
            break

    results = {}
    for name in names:
        med = statistics.median(times[name])
        ratios = [t / u for t, u in zip(times[name], times["untraced"], strict=True)]
        results[name] = {
            "median_ms": round(med * 1e3, 2),
            "ratio": round(statistics.median(ratios), 4),
            "ratio_of_medians": round(med / statistics.median(times["untraced"]), 4),
            "min_ms": round(min(times[name]) * 1e3, 2),
            "ratio_best_of": round(min(times[name]) / min(times["untraced"]), 4),
            "cpu_ratio": round(statistics.median(_ratios(cpu_times[name][-rounds:], cpu_times["untraced"][-rounds:])), 4),
        }
        if name.startswith(("trace", "old_")) and name != "tracer_empty" and drafts:
            vs_mtp = [t / u for t, u in zip(times[name], times["untraced_mtp"], strict=True)]
            results[name]["vs_mtp"] = round(statistics.median(vs_mtp), 4)
    results["tracer_empty"]["hooks"] = tracer_empty.hooks
    results["noop_hooks"]["hooks"] = len(points)
    results["tracer_default"]["hooks"] = tracer_default.hooks

    def within(name: str, limit: float) -> dict:
        return {"median": results[name]["ratio"] <= limit, "best_of": results[name]["ratio_best_of"] <= limit}

    # the traces themselves, and the CSV export of all their tables
    traces = {"default": trace_default(), "all": trace_all()}
    export = {}
    for label, trace in traces.items():
        build, write = [], []
        with tempfile.TemporaryDirectory(prefix="bench-trace-") as tmp:
            for i in range(opts.export_reps):
                start = time.perf_counter()
                frames = tables.tables(trace)
                mid = time.perf_counter()
                tables.write_tables(frames, Path(tmp) / f"csv{i}")
                end = time.perf_counter()
                build.append(mid - start)
                write.append(end - mid)
            files = sorted((Path(tmp) / "csv0").glob("*.csv"))
            start = time.perf_counter()
            tables.export(trace, Path(tmp) / "export")  # the public entry point, once, for the record
            export_once = time.perf_counter() - start
            sizes = {f.stem: f.stat().st_size for f in files}
        total = [b + w for b, w in zip(build, write, strict=True)]
        export[label] = {
            "sites": len(trace.tensors) - 1,
            "trace_mb": round(sum(t.numel() * t.element_size() for t in trace.tensors.values()) / 2**20, 2),
            "export_s_median": round(statistics.median(total), 3),
            "export_s_once_via_tables_export": round(export_once, 3),
            "tables_build_s": round(statistics.median(build), 3),
            "csv_write_s": round(statistics.median(write), 3),
            "rows": {name: len(frame) for name, frame in frames.items()},
            "csv_mb": round(sum(sizes.values()) / 2**20, 2),
            "under_2s": statistics.median(total) < 2.0,
        }

    out = {
        "benchmark": "tracing overhead on a prefill and CSV export",
        "note": (
            f"torch.set_num_threads({opts.threads}) on a 2-core CPU shared with a colleague's training job (see the "
            "load averages), OMP_WAIT_POLICY PASSIVE unless set (environment.omp_env): absolute times are noisy; "
            "variants are interleaved round by round (rotated order) and "
            "compared to the same round's untraced forward: ratio = median over rounds of variant / untraced; "
            "ratio_best_of = fastest variant round / fastest untraced round (least disturbed by the background load); "
            "cpu_ratio = the same median over this process's CPU time (time.process_time) rather than wall time"
        ),
        "model": info,
        "dtype": opts.dtype,
        "tokens": len(ids),
        "rounds": rounds,
        "hook_points": len(points),
        "old_tree": str(opts.old_tree) if opts.old_tree else None,
        "results": results,
        "targets": {
            "trace_default_within_1.15x": within("trace_default", 1.15),
            "noop_hooks_within_1.02x": within("noop_hooks", 1.02),
            "tracer_empty_within_1.02x": within("tracer_empty", 1.02),
            "csv_export_default_under_2s": export["default"]["under_2s"],
            "csv_export_all_under_2s": export["all"]["under_2s"],
        },
        "csv_export": export,
        "environment": {
            "torch": torch.__version__,
            "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")},
            "threads": torch.get_num_threads(),
            "load_average_start": load_start,
            "load_average_end": load_average(),
        },
        "wall_s": round(time.perf_counter() - wall, 1),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    from model import kernels

    with kernels.serial_passes():  # our forwards under the thread policy, as the command line runs them
        main()
