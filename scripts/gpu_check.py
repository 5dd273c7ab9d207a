"""The node check: what users run, on a synthetic checkpoint of real width, in one prepared run.

A GPU session is short and rare, so this is one command of at most ``--budget-s`` seconds (540 by
default: a 10-minute slot on one H200 with room to start) that tries everything a node user
depends on and keeps every figure it got, whatever fails later. Each phase is timed, wrapped (an
exception is that phase's failure, not the run's end) and written to the JSON file at once; a
phase that no longer fits in the budget is skipped and says so.

1. ``disk``: the 671B config cut to its first ``--n-layers`` blocks (default 4: 3 dense, 1 MoE, the
   real width) generated (model.synthetic), written as a checkpoint under ``--workdir`` (fsync'd)
   and read back from disk (page cache dropped for its files first): write and read GB/s.
2. ``run``: ``python -m tracing run`` on that checkpoint, resident and with ``--stream``, the same
   ``--compare-tokens`` prompt; their selections (every ``*.topk_indices``) must be equal.
3. ``server``: ``torchrun --nproc-per-node R -m tracing serve`` on it (R: the GPUs), started with a
   test-only fault (``ANATOMY_SERVER_FAULTS``) that makes the last rank fail its second request:
   a good request, a bad one (``temperature: 1e-320``, one 4xx line), the failing one (one 5xx line),
   a good one again (the server goes on), then ``--tokens`` prompt tokens plus ``--generate`` tokens,
   timed. The server is stopped at the end, and its process group killed on any failure.
4. ``plan``: ``python -m tracing plan --ranks 1 --device-memory <free> --tokens T --json`` against
   the measured peak of the same traced prefill in this process (``torch.cuda.max_memory_allocated``
   on a GPU; on the CPU the allocations tracing.plan.Allocations counts, with the weights held).
5. ``kernels``: the CUDA route of the FP8 products (model/kernels/cuda.py) against the plain
   functions of model/fp8.py on this device, at real widths (bit-equal share, largest difference,
   milliseconds each way), and the tiny model traced both ways with
   ``torch.cuda.set_sync_debug_mode("warn")``: the host synchronisations of each way's second run
   (the first judges every weight's scales once), and how many recorded values and selections
   differ. On the CPU the products are compared at small widths (bit for bit expected there) and
   the traced forward is left out (the dispatcher takes the CUDA route for CUDA tensors only).
6. ``tiers``: the checkpoint streamed in this process with the default budgets (model.tiers): two
   identical ``--tokens`` requests (each one's bytes from disk, from host memory and kept on the
   device, and its seconds; with the whole model in the device budget the second must read
   nothing from disk), then ``--generate`` tokens after the same prompt: the decode steps' routed
   experts by where they came from, and the device tier's hit rate.
7. ``cpu_compare``: phase 2's prompt on the CPU (streamed): how many selections differ from the
   GPU's. Reported, not failed: a GPU sums float32 products in cuBLAS's order, not the CPU's. Last,
   because on the node's 16 cores it is the slowest phase; it gets what is left of the budget.

On one H200 (no network needed; the checkpoint takes about 17 GB under ``--workdir``):

    python scripts/gpu_check.py --out gpu_check.json

The CPU smoke test of every phase's code path (tests/model/test_stream.py runs it on a tiny config):

    python scripts/gpu_check.py --device cpu --config tiny.json --tokens 12 --generate 2 --compare-tokens 6

Writes one JSON object to ``--out`` (rewritten after every phase): ``ok``, ``budget_s``,
``elapsed_s``, the environment, and ``phases``, a list of ``{"name", "status" (pass, fail, skipped),
"seconds", "reason", ...figures}``; prints a table of them. Exits 0 when every phase passed (a skipped phase checked nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tracing.startup import load_torch  # noqa: E402

load_torch()

import torch  # noqa: E402

from model.config import ModelArgs  # noqa: E402

DEFAULT_CONFIG = REPO / "assets" / "configs" / "config_671B_hf.json"
GB = 1e9
READ_CHUNK = 64 << 20


class Skip(Exception):
    """A phase that cannot run (no time left, or what it needs failed): skipped, with the reason."""


class Check:
    """The run's phases, their results and the global deadline; the JSON file after each phase."""

    def __init__(self, opts: argparse.Namespace):
        self.opts = opts
        self.started = time.monotonic()
        self.deadline = self.started + opts.budget_s
        self.summary: dict = {
            "ok": True,
            "budget_s": opts.budget_s,
            "elapsed_s": 0.0,
            "device": opts.device,
            "device_name": device_name(opts.device),
            "gpus": torch.cuda.device_count() if opts.device == "cuda" else 0,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "config": str(opts.config),
            "n_layers": opts.n_layers,
            "tokens": opts.tokens,
            "generate": opts.generate,
            "compare_tokens": opts.compare_tokens,
            "phases": [],
        }
        self.found: dict = {}  # what later phases need: the checkpoint, the GPU's trace files

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def timeout(self, reserve: float = 0.0) -> float:
        """Seconds a step may take: what is left of the budget less ``reserve`` (for later phases)."""
        seconds = self.left() - reserve
        if seconds < 5:
            budget = f"{self.left():.0f} s of the {self.opts.budget_s:.0f} s budget"
            raise Skip(f"no time left ({budget}, {reserve:.0f} s kept for later phases)")
        return seconds

    def phase(self, name: str, body: Callable[[dict], None], needs: tuple[str, ...] = (), at_least: float = 5.0) -> None:
        result: dict = {"name": name, "status": "pass", "seconds": 0.0, "reason": ""}
        self.summary["phases"].append(result)
        start = time.monotonic()
        try:
            missing = [n for n in needs if n not in self.found]
            if missing:
                raise Skip(f"needs {', '.join(missing)}, which an earlier phase did not give")
            if self.left() < at_least:
                raise Skip(f"no time left: {self.left():.0f} s of the budget, this phase needs at least {at_least:.0f} s")
            body(result)
        except Skip as exc:
            result["status"], result["reason"] = "skipped", str(exc)
        except Exception as exc:  # the phase fails; the run and the earlier figures go on
            result["status"], result["reason"] = "fail", f"{type(exc).__name__}: {exc}"[:2000]
            result["traceback"] = traceback.format_exc()[-4000:]
        if result["status"] == "pass" and result.get("problems"):
            result["status"], result["reason"] = "fail", "; ".join(result["problems"])[:2000]
        result["seconds"] = round(time.monotonic() - start, 2)
        self.summary["ok"] = all(p["status"] == "pass" for p in self.summary["phases"])
        self.write()

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.monotonic() - self.started, 2)
        text = json.dumps(self.summary, indent=1, default=str)
        tmp = self.opts.out.with_name(self.opts.out.name + ".part")
        tmp.write_text(text + "\n")
        tmp.replace(self.opts.out)  # a reader never sees half a file


# --- helpers ----------------------------------------------------------------------------------------


def device_name(device: str) -> str:
    if device != "cuda":
        return platform.processor() or "cpu"
    try:
        return torch.cuda.get_device_name(0)
    except Exception as exc:  # said in the file; the phases fail one by one with their own reasons
        return f"unavailable: {type(exc).__name__}: {exc}"[:300]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(argv: list[str], timeout: float, env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    """``argv`` in the repository (its own process group, killed whole at the timeout); with its seconds."""
    start = time.monotonic()
    env = {**os.environ, **(env or {})}
    pipe = subprocess.PIPE
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        raise TimeoutError(f"{' '.join(argv[3:6])} ... ran past {timeout:.0f} s: {err[-500:]}") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err), time.monotonic() - start


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_server(proc: subprocess.Popen, workers: set[int]) -> bool:
    """Stop a server under torchrun as a user does: SIGTERM to its ranks (each ends cleanly, then
    torchrun with status 0), to torchrun itself after 30 s; then SIGKILL to whatever is left of
    torchrun's process group and of each rank's (torchrun starts each rank in a session of its own).
    ``workers``: the ranks' pids seen so far. True when the server ended by itself with status 0."""
    workers |= set(children(proc.pid))
    for pid in workers:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for sig in (signal.SIGTERM, None):
        try:
            proc.wait(30)
            break
        except subprocess.TimeoutExpired:
            if sig is not None:
                proc.send_signal(sig)
    clean = proc.poll() == 0 and bool(workers)
    for group in (proc.pid, *workers):
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()
    return clean


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def token_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def selections(path: Path) -> dict[str, torch.Tensor]:
    from tracing.trace import Trace

    trace = Trace.load(path)
    return {name: t for name, t in trace.tensors.items() if name.endswith("topk_indices")}


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """How many selections differ: per site, the rows (positions) whose chosen sets differ."""
    sites = sorted(set(a) | set(b))
    differ: dict[str, int] = {}
    rows = 0
    for name in sites:
        if name not in a or name not in b or a[name].shape != b[name].shape:
            differ[name] = -1  # missing or another shape
            continue
        x, y = a[name].sort(-1).values, b[name].sort(-1).values  # a set: the order within a row is not compared
        n = int((x != y).reshape(x.shape[0], -1).any(-1).sum()) if x.dim() else int(x != y)
        rows += x.shape[0] if x.dim() else 1
        if n:
            differ[name] = n
    differing = sum(max(n, 0) for n in differ.values())
    return {"sites": len(sites), "rows": rows, "rows_differing": differing, "sites_differing": differ}


def device_free(device: str) -> int:
    if device == "cuda":
        return torch.cuda.mem_get_info(0)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


# --- the phases -------------------------------------------------------------------------------------


def disk_phase(check: Check, result: dict) -> None:
    from model.checkpoint import SafetensorsSource, save_checkpoint
    from model.synthetic import SyntheticSource, truncate_layers

    opts = check.opts
    args = ModelArgs.from_file(opts.config)
    args = truncate_layers(args, opts.n_layers if opts.n_layers is not None else min(4, args.n_layers))
    check.found["args"] = args
    directory = Path(tempfile.mkdtemp(prefix="gpu_check-", dir=opts.workdir)) / "checkpoint"
    check.found["workdir"] = directory.parent
    source = SyntheticSource(args, opts.seed)
    t = time.monotonic()
    made = torch.device(opts.device)  # a GPU draws the 17 GB in seconds, 16 CPU cores in minutes
    tensors = {name: source.load(name, made).cpu() for name in source.specs()}
    result["generate_s"] = round(time.monotonic() - t, 2)
    check.timeout()
    t = time.monotonic()
    save_checkpoint(tensors, args, directory)
    files = sorted(directory.glob("*.safetensors"))
    for f in files:  # on the disk, not in the page cache
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    write_s = time.monotonic() - t
    size = sum(f.stat().st_size for f in files)
    result.update(checkpoint=str(directory), blocks=args.n_layers, dim=args.dim, experts=args.n_routed_experts, bytes=size)
    result.update(write_s=round(write_s, 2), write_gbps=round(size / write_s / GB, 3))
    del tensors
    for f in files:  # the reads below come from the disk
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    check.timeout()
    t = time.monotonic()
    buffer = bytearray(READ_CHUNK)
    read = 0
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buffer):
                read += n
    read_s = time.monotonic() - t
    stored = SafetensorsSource(directory).specs()
    problems = []
    if set(stored) != set(source.specs()):
        problems.append(f"the checkpoint holds {len(stored)} tensors, the config names {len(source.specs())}")
    name = "model.embed_tokens.weight"
    if name in stored and not torch.equal(SafetensorsSource(directory).load(name), source.load(name, made).cpu()):
        problems.append(f"{name} read back differs from what was written")
    result.update(read_s=round(read_s, 2), read_gbps=round(read / read_s / GB, 3), tensors=len(stored), problems=problems)
    check.found["checkpoint"] = directory


def run_phase(check: Check, result: dict) -> None:
    opts, directory = check.opts, check.found["checkpoint"]
    ids = token_ids(opts.compare_tokens, check.found["args"].vocab_size, opts.seed)
    check.found["compare_ids"] = ids
    traces = check.found["workdir"] / "traces"
    traces.mkdir(exist_ok=True)
    problems = []
    for mode, extra in (("resident", []), ("stream", ["--stream"])):
        out = traces / f"{opts.device}-{mode}.safetensors"
        argv = [sys.executable, "-m", "tracing", "run", "--checkpoint", str(directory), "--device", opts.device]
        argv += ["--token-ids", ",".join(map(str, ids)), "--out", str(out), *extra]
        done, seconds = command(argv, check.timeout(reserve=opts.reserve_s))
        result[mode] = {"seconds": round(seconds, 2), "exit": done.returncode}
        if done.returncode != 0:
            problems.append(f"run {mode}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
            continue
        result[mode]["trace_bytes"] = out.stat().st_size
        check.found[f"trace_{mode}"] = out
    if "trace_resident" in check.found and "trace_stream" in check.found:
        same = compare(selections(check.found["trace_resident"]), selections(check.found["trace_stream"]))
        result["resident_vs_stream"] = same
        if same["sites_differing"]:
            problems.append(f"resident and streamed selections differ in {same['rows_differing']} rows")
    result["problems"] = problems


def server_phase(check: Check, result: dict) -> None:
    import httpx

    from tracing.client import Client
    from tracing.runner import TraceRequest

    opts, directory = check.opts, check.found["checkpoint"]
    ranks = opts.ranks
    port = free_port()
    # the last rank raises at the start of block 0 of its 2nd request (the bad one never reaches a rank)
    faults = {"ANATOMY_SERVER_FAULTS": f"{ranks - 1}:2:0:error"}
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    launch += ["--master-addr", "127.0.0.1", "--master-port", str(free_port())]
    serve = ["-m", "tracing", "serve", "--checkpoint", str(directory), "--device", opts.device, "--port", str(port)]
    serve += ["--max-prompt-tokens", str(max(opts.tokens, 64)), "--max-generate", str(max(opts.generate, 2))]
    serve += ["--max-seconds", f"{max(check.left(), 10):.0f}"]  # no request runs past the budget
    result.update(ranks=ranks, faults=faults["ANATOMY_SERVER_FAULTS"])
    log = check.found["workdir"] / "server.log"
    started = time.monotonic()
    with open(log, "wb") as sink:
        env = {**os.environ, **faults}
        argv = [*launch, *serve]
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    problems: list[str] = []
    result["problems"] = problems
    args = check.found["args"]
    workers: set[int] = set()
    try:
        deadline = started + check.timeout(reserve=opts.reserve_s)
        health = None
        while time.monotonic() < deadline:
            workers |= set(children(proc.pid))
            if proc.poll() is not None:
                raise RuntimeError(f"the server stopped (exit {proc.returncode}): {log.read_text(errors='replace')[-800:]}")
            try:
                answer = httpx.get(f"{url}/health", timeout=2)
                if answer.status_code == 200:
                    health = answer.json()
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        if health is None:
            raise RuntimeError(f"/health did not answer 200 within {deadline - started:.0f} s")
        result["start_s"] = round(time.monotonic() - started, 2)
        result["load"] = health.get("load", {}).get("line") if isinstance(health.get("load"), dict) else health.get("load")
        short = token_ids(8, args.vocab_size, opts.seed + 1)

        def good(label: str) -> None:
            t = time.monotonic()
            with Client(url) as client:
                trace = client.trace(TraceRequest(token_ids=tuple(short), generate=2))
            generated = trace.extra["generation"]["generated"]
            result[label] = {"seconds": round(time.monotonic() - t, 3), "generated": generated}
            if generated != 2:
                problems.append(f"{label}: generated {generated} tokens, asked 2")

        def lines(body: dict) -> tuple[int, list[dict]]:
            answer = httpx.post(f"{url}/trace", json=body, timeout=max(check.timeout(), 5))
            if answer.status_code != 200:
                try:
                    return answer.status_code, [answer.json()]
                except ValueError:
                    return answer.status_code, [{"error": answer.text[:300], "not_json": True}]
            return 200, [json.loads(line) for line in answer.content.splitlines() if line.startswith(b"{")]

        good("good")
        check.timeout()
        status, said = lines({"token_ids": short, "generate": 2, "temperature": 1e-320})
        errors = [e for e in said if "error" in e]
        result["bad"] = {"status": status, "error": errors[-1]["error"][:300] if errors else None}
        if not (400 <= status < 500 and len(errors) == 1):
            problems.append(f"bad request: status {status}, {len(errors)} error lines, expected one 4xx line")
        check.timeout()
        status, said = lines({"token_ids": short, "generate": 2})
        errors = [e for e in said if "error" in e]
        last = errors[-1] if errors else {}
        result["rank_fault"] = {"status": last.get("status", status), "error": str(last.get("error"))[:300]}
        if len(errors) != 1 or not 500 <= int(last.get("status", 0)) < 600 or "injected fault" not in str(last.get("error")):
            got = f"{len(errors)} error lines ({said[-1:]})"
            problems.append(f"the request failing on rank {ranks - 1}: {got}, expected one 5xx line")
        check.timeout()
        good("good_after_fault")
        check.timeout()
        long = token_ids(opts.tokens, args.vocab_size, opts.seed + 2)
        t = time.monotonic()
        blocks: list[float] = []
        with Client(url) as client:
            trace = client.trace(
                TraceRequest(token_ids=tuple(long), generate=opts.generate),
                on_progress=lambda event: blocks.append(time.monotonic()) if "progress" in event else None,
            )
        seconds = time.monotonic() - t
        generated = trace.extra["generation"]["generated"]
        result["long"] = {"tokens": opts.tokens, "generated": generated, "seconds": round(seconds, 3)}
        result["long"]["progress_lines"] = len(blocks)
        if generated != opts.generate:
            problems.append(f"long request: generated {generated} tokens, asked {opts.generate}")
        with Client(url) as client:
            result["health_after"] = {k: client.health().get(k) for k in ("queue", "running", "ranks")}
    finally:
        result["stopped_cleanly"] = stop_server(proc, workers)
        if not result["stopped_cleanly"]:
            problems.append(f"the server did not stop cleanly on SIGTERM (torchrun's status {proc.returncode})")
        result["log_tail"] = log.read_text(errors="replace")[-1500:]


def plan_phase(check: Check, result: dict) -> None:
    from model import kernels
    from model.stream import held_bytes
    from tracing.cli.loading import open_checkpoint
    from tracing.plan import Allocations
    from tracing.runner import TraceRequest
    from tracing.runner import run as run_request

    opts, directory = check.opts, check.found["checkpoint"]
    free = device_free(opts.device)
    argv = [sys.executable, "-m", "tracing", "plan", "--checkpoint", str(directory), "--ranks", "1"]
    argv += ["--device-memory", str(free), "--tokens", str(opts.tokens), "--device", opts.device, "--json"]
    done, seconds = command(argv, check.timeout(reserve=opts.reserve_s))
    if done.returncode != 0:
        raise RuntimeError(f"plan: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    plan = json.loads(done.stdout)
    rank = plan["per_rank"][0]
    result.update(plan_s=round(seconds, 2), free_gb=round(free / GB, 3), plan_load=plan["load"], plan_fits=plan["fits"])
    result["predicted"] = rank
    check.timeout()
    device = torch.device(opts.device)
    loaded = open_checkpoint(directory, device)
    ids = token_ids(opts.tokens, loaded.model.args.vocab_size, opts.seed + 2)
    request = TraceRequest(token_ids=tuple(ids), record=("default",))
    t = time.monotonic()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        weights = torch.cuda.memory_allocated(device)
        run_request(loaded.model, request, device=device)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated(device)
        how = "torch.cuda.max_memory_allocated"
    else:
        weights = held_bytes(loaded.model, "cpu")
        with kernels.plain(), Allocations(meta=False) as counted:  # the products as a GPU forms them
            trace = run_request(loaded.model, request, device=device)
            del trace
        measured = weights + counted.peak
        how = "the weights held plus tracing.plan.Allocations' peak"
    result["trace_s"] = round(time.monotonic() - t, 2)
    del loaded
    if device.type == "cuda":
        torch.cuda.empty_cache()
    predicted = rank["total_gb"] * GB
    result.update(
        measured_by=how,
        weights_measured_gb=round(weights / GB, 3),
        measured_peak_gb=round(measured / GB, 3),
        predicted_total_gb=rank["total_gb"],
        predicted_over_measured=round(predicted / measured, 3),
    )
    if abs(predicted - measured) > 0.2 * measured:
        result["problems"] = [f"the plan says {predicted / GB:.2f} GB, the run peaked at {measured / GB:.2f} GB (over 20% apart)"]


def product_comparison(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How far two results are apart: the share of values equal bit for bit, the largest absolute
    difference, and that over the largest magnitude."""
    a, b = a.float(), b.float()
    diff = float((a - b).abs().max())
    equal = round(float((a == b).float().mean()), 6)
    return {"equal_share": equal, "max_abs_diff": diff, "max_rel": diff / max(float(b.abs().max()), 1e-30)}


def milliseconds(fn: Callable[[], object], device: torch.device, reps: int = 5) -> float:
    """Median milliseconds of ``fn`` (after one warm-up call), synchronised on a GPU."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t) * 1e3)
    return round(sorted(times)[len(times) // 2], 3)


def time_products(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, fmt: str | None) -> dict:
    """model.kernels.cuda's fp8_gemm against model.fp8's on one input: how far apart, and the
    milliseconds of each (the route with its weight copy made per product, and kept)."""
    from model import fp8
    from model.kernels import cuda

    unkept, kept = w.detach(), w.detach()  # tensors of their own: no copy kept with either yet
    cuda.set_copy_budget(0)
    row = product_comparison(cuda.fp8_gemm(x, unkept, s, fmt), fp8.fp8_gemm(x, w, s, fmt))
    if x.device.type == "cuda":  # what one product allocates beyond what is held: the plain one widens the weight
        for way, product in (("plain", fp8.fp8_gemm), ("route", cuda.fp8_gemm)):
            torch.cuda.synchronize(x.device)
            held = torch.cuda.memory_allocated(x.device)
            torch.cuda.reset_peak_memory_stats(x.device)
            product(x, unkept, s, fmt)
            row[f"{way}_extra_mb"] = round((torch.cuda.max_memory_allocated(x.device) - held) / 2**20, 1)
    row["plain_ms"] = milliseconds(lambda: fp8.fp8_gemm(x, w, s, fmt), x.device)
    row["route_ms"] = milliseconds(lambda: cuda.fp8_gemm(x, unkept, s, fmt), x.device)
    cuda.set_copy_budget(1 << 40)
    row["route_kept_ms"] = milliseconds(lambda: cuda.fp8_gemm(x, kept, s, fmt), x.device)
    return row


def kernels_phase(check: Check, result: dict) -> None:
    import warnings

    from model import TINY, fp8
    from model import kernels as routes
    from model.checkpoint import load_model
    from model.kernels import cuda
    from model.synthetic import SyntheticSource
    from tracing.runner import trace_tokens

    device = torch.device(check.opts.device)
    gpu = device.type == "cuda"
    problems: list[str] = []
    # (N, K) of the 671B's weights (kv_a_proj_with_mqa, an expert's w1 and w2, a dense w2); small on the CPU
    shapes = [(576, 7168), (2048, 7168), (7168, 2048), (7168, 18432)] if gpu else [(576, 1024), (256, 512)]
    rows = (1, 64, 512) if gpu else (1, 17)
    budget = cuda.copy_bytes()[1]
    products: list[dict] = []
    result["products"] = products  # kept as they come: a phase out of time keeps what it measured
    gen = torch.Generator(device).manual_seed(check.opts.seed)  # drawn where they are used: 16 CPU cores are slow at it
    try:  # the copies' budget set for each measurement, given back after
        for (n, k), fmt in ((shape, fmt) for shape in shapes for fmt in ("ue8m0", None)):
            check.timeout(reserve=check.opts.reserve_s)
            w, s = fp8.weight_quant(torch.randn(n, k, generator=gen, device=device) * 0.02, fmt)
            for m in rows:
                x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
                row = {"n": n, "k": k, "rows": m, "scales": fmt or "amax/448", **time_products(x, w, s, fmt)}
                products.append(row)
                if row["max_rel"] > 1e-2 or not gpu and row["equal_share"] != 1.0:
                    problems.append(f"fp8_gemm {n}x{k}, {m} rows, {row['scales']}: {row}")
            for dtype in (torch.bfloat16, torch.float32):
                if not torch.equal(cuda.dequantize(w, s, dtype), fp8.weight_dequant(w, s, dtype)):
                    problems.append(f"weight_dequant {n}x{k} {fmt} {dtype}: not the plain function's values")
    finally:
        cuda.set_copy_budget(budget)
    result["products_equal_share"] = round(sum(p["equal_share"] for p in products) / max(len(products), 1), 6)
    result["products_max_rel"] = max((p["max_rel"] for p in products), default=0.0)
    if not gpu:
        result["forward"] = "not on the CPU: the dispatcher takes the CUDA route for CUDA tensors only"
        result["problems"] = problems
        return
    check.timeout(reserve=check.opts.reserve_s)
    ids = token_ids(32, TINY.vocab_size, check.opts.seed)
    traces, syncs = {}, {}
    for fmt in ("ue8m0", None):
        model = load_model(SyntheticSource(TINY.replace(scale_fmt=fmt), seed=1), device=device)
        for way, context in (("plain", routes.plain), ("route", contextlib.nullcontext)):
            counts = []
            for _ in range(2):  # the first run judges each weight's scales once; the second is every later run
                with context(), warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        trace = trace_tokens(model, ids, record="default", prefill=len(ids) - 4, device=device)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                counts.append(sum("synchroniz" in str(w.message) for w in caught))
            syncs[f"{fmt or 'amax/448'} {way}"] = counts
            traces[way] = trace
        a, b = traces["route"].tensors, traces["plain"].tensors
        equal = sum(torch.equal(a[name], b[name]) for name in b if name in a)
        label = fmt or "amax/448"
        result[f"trace_{label}"] = {
            "values_equal": f"{equal} of {len(b)}",
            "logits": product_comparison(a["logits.last"], b["logits.last"]) if "logits.last" in b else None,
            "selections": compare(*({n: t for n, t in x.items() if n.endswith("topk_indices")} for x in (a, b))),
        }
        route, plain = syncs[f"{label} route"][1], syncs[f"{label} plain"][1]
        if route > plain:
            problems.append(f"{label}: the route's second forward synchronised {route} times, the plain one's {plain}")
        del model
    result["syncs_first_second"] = syncs


def tiers_phase(check: Check, result: dict) -> None:
    from collections import Counter

    from tracing.cli.loading import open_checkpoint
    from tracing.runner import TraceRequest
    from tracing.runner import run as run_request

    opts, device = check.opts, torch.device(check.opts.device)
    loaded = open_checkpoint(check.found["checkpoint"], device, stream=True, tokens=opts.tokens + opts.generate)
    tiers = loaded.tiers
    result.update(device_budget_gb=round(tiers.device_tier.budget / GB, 3), host_budget_gb=round(tiers.host_tier.budget / GB, 3))
    ids = token_ids(opts.tokens, loaded.model.args.vocab_size, opts.seed + 3)

    def timed(request: TraceRequest, on_step=None, context=None) -> tuple[dict, float]:
        check.timeout(reserve=opts.reserve_s / 2)
        t = time.monotonic()
        trace = run_request(loaded.model, request, device=device, context=context or loaded.context(), on_step=on_step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return trace.extra["stream"], round(time.monotonic() - t, 2)

    for k in ("first", "second"):
        figures, seconds = timed(TraceRequest(token_ids=tuple(ids), record=("default",)))
        result[k] = {**figures, "seconds": seconds}
    streamer, after_prefill = loaded.context(), Counter()

    def on_step(step: int, steps: int) -> None:
        if step == 1:  # the prefill is done: what follows is the decode steps'
            after_prefill.update(streamer.stats.experts)

    request = TraceRequest(token_ids=tuple(ids), generate=opts.generate, record=("default",))
    figures, seconds = timed(request, on_step, streamer)
    decode = streamer.stats.experts - after_prefill
    taken = sum(decode.values())
    result["decode"] = {
        **figures,
        "seconds": seconds,
        "tokens": opts.generate,
        "experts": dict(decode),
        "expert_hit_rate": round(decode["device"] / taken, 4) if taken else None,
    }
    problems = []
    if tiers.device_tier.budget >= tiers.device_tier.peak + result["first"]["disk_bytes"] and result["second"]["disk_bytes"]:
        problems.append(f"the device budget holds the model, yet the second request read {result['second']['disk_bytes']} bytes")
    for tier in (tiers.device_tier, tiers.host_tier):
        if tier.peak > tier.budget:
            problems.append(f"the {tier.name} tier held {tier.peak} bytes, over its budget of {tier.budget}")
    result["peak_gb"] = {"device": round(tiers.device_tier.peak / GB, 3), "host": round(tiers.host_tier.peak / GB, 3)}
    result["problems"] = problems


def cpu_compare_phase(check: Check, result: dict) -> None:
    opts = check.opts
    ids = check.found["compare_ids"]
    out = check.found["workdir"] / "traces" / "cpu-reference.safetensors"
    argv = [sys.executable, "-m", "tracing", "run", "--checkpoint", str(check.found["checkpoint"]), "--device", "cpu", "--stream"]
    argv += ["--token-ids", ",".join(map(str, ids)), "--out", str(out)]
    timeout = check.timeout(reserve=5)
    try:
        done, seconds = command(argv, timeout)
    except TimeoutError:
        raise Skip(f"the CPU run did not finish in the {timeout:.0f} s left of the budget (fewer --compare-tokens)") from None
    result.update(seconds_cpu=round(seconds, 2), tokens=len(ids))
    if done.returncode != 0:
        raise RuntimeError(f"run on the CPU: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    cpu = selections(out)
    for mode in ("resident", "stream"):
        if f"trace_{mode}" in check.found:
            result[f"{opts.device}_{mode}_vs_cpu"] = compare(selections(check.found[f"trace_{mode}"]), cpu)


# --- the table and the command line -----------------------------------------------------------------

FIGURES = {
    "disk": lambda r: f"{r.get('bytes', 0) / GB:.1f} GB, write {r.get('write_gbps')} GB/s, read {r.get('read_gbps')} GB/s",
    "run": lambda r: (
        " | ".join(f"{m} {r[m]['seconds']} s" for m in ("resident", "stream") if isinstance(r.get(m), dict))
        + (f" | selections differ in {r['resident_vs_stream']['rows_differing']} rows" if "resident_vs_stream" in r else "")
    ),
    "server": lambda r: (
        f"up in {r.get('start_s')} s, bad {r.get('bad', {}).get('status')}, fault "
        f"{r.get('rank_fault', {}).get('status')}, {r.get('long', {}).get('tokens')}+{r.get('long', {}).get('generated')} tokens "
        f"in {r.get('long', {}).get('seconds')} s"
    ),
    "plan": lambda r: (
        f"plan {r.get('predicted_total_gb')} GB, measured {r.get('measured_peak_gb')} GB "
        f"(x{r.get('predicted_over_measured')}), load {r.get('plan_load')}"
    ),
    "kernels": lambda r: (
        f"fp8_gemm route vs plain: {r.get('products_equal_share')} bit-equal, max rel diff {r.get('products_max_rel'):.2e}"
        + "".join(f" | syncs {k}: {v}" for k, v in r.get("syncs_first_second", {}).items())
    ),
    "tiers": lambda r: (
        f"second request {r['second']['disk_bytes'] / GB:.2f} GB from disk in {r['second']['seconds']} s "
        f"(first {r['first']['disk_bytes'] / GB:.2f} GB in {r['first']['seconds']} s), {r['decode']['tokens']} tokens "
        f"in {r['decode']['seconds']} s, experts' hit rate {r['decode']['expert_hit_rate']}"
    ),
    "cpu_compare": lambda r: (
        "; ".join(f"{k[:-7]}: {v['rows_differing']} of {v['rows']} rows differ" for k, v in r.items() if k.endswith("_vs_cpu"))
        + f" (CPU {r.get('seconds_cpu')} s)"
    ),
}


def table(summary: dict) -> str:
    rows = [("phase", "status", "seconds", "figures")]
    for p in summary["phases"]:
        try:
            figures = FIGURES[p["name"]](p) if p["status"] != "skipped" else ""
        except Exception:  # a failed phase has only some of its figures
            figures = ""
        if p["reason"]:
            figures = (figures + " | " if figures else "") + p["reason"][:160]
        rows.append((p["name"], p["status"], f"{p['seconds']:.1f}", figures))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:3], widths, strict=True)) + "  " + r[3] for r in rows]
    ok = "ok" if summary["ok"] else "FAILED"
    return "\n".join([*lines, f"{ok} in {summary['elapsed_s']:.0f} s of {summary['budget_s']:.0f} s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config.json (default: the 671B config)")
    parser.add_argument("--n-layers", type=int, default=None, help="keep the first N blocks (default 4, or all of fewer)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--ranks", type=int, default=None, help="the server's ranks (default: the GPUs, 1 on the CPU)")
    parser.add_argument("--tokens", type=int, default=512, help="the server's long prompt and the plan's (default 512)")
    parser.add_argument("--generate", type=int, default=32, help="tokens the long request generates (default 32)")
    parser.add_argument("--compare-tokens", type=int, default=64, help="prompt of the GPU/CPU comparison (default 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budget-s", type=float, default=540.0, help="the whole run's seconds (default 540)")
    parser.add_argument("--reserve-s", type=float, default=None, help="seconds a phase leaves for those after it")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()), help="where the checkpoint is written")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and traces (removed by default)")
    parser.add_argument("--out", type=Path, default=Path("gpu_check.json"), help="the JSON file (default gpu_check.json)")
    opts = parser.parse_args(argv)
    if opts.ranks is None:
        opts.ranks = max(torch.cuda.device_count(), 1) if opts.device == "cuda" else 1
    if opts.reserve_s is None:  # the later phases' share: the server and the plan need about a minute each
        opts.reserve_s = min(120.0, opts.budget_s / 5)
    opts.workdir.mkdir(parents=True, exist_ok=True)
    check = Check(opts)
    try:
        check.phase("disk", lambda r: disk_phase(check, r), at_least=30)
        check.phase("run", lambda r: run_phase(check, r), needs=("checkpoint",), at_least=20)
        check.phase("server", lambda r: server_phase(check, r), needs=("checkpoint",), at_least=20)
        check.phase("plan", lambda r: plan_phase(check, r), needs=("checkpoint",), at_least=10)
        check.phase("kernels", lambda r: kernels_phase(check, r), at_least=20)
        check.phase("tiers", lambda r: tiers_phase(check, r), needs=("checkpoint",), at_least=20)
        check.phase("cpu_compare", lambda r: cpu_compare_phase(check, r), needs=("checkpoint", "compare_ids"), at_least=10)
    finally:
        if not opts.keep and "workdir" in check.found:
            shutil.rmtree(check.found["workdir"], ignore_errors=True)
        check.write()
    print(table(check.summary))
    print(f"written: {opts.out}")
    return 0 if check.summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
