"""The real-size check: a traced prefill through the 671B architecture, streamed block by block,
through what users run: the Tracer (tracing.run with a TraceRequest) and the model server.

Synthetic FP8 weights with the real names and shapes (model.synthetic.SyntheticSource, made on
the device), all blocks streamed (model.stream). Phase 1 traces the default sites in this process
(tracing.runner.run, the Streamer as its context) and reports per-block compute time, weight
generation time and bytes per second, peak GPU memory and peak host memory; it checks the recorded
values against the trace contract of docs/architecture.md (names, shapes, dtypes, -inf / -1
conventions). Phase 2 (unless ``--no-server``) starts ``python -m tracing serve`` on the same
synthetic weights, streamed, sends the same request and checks that the server's trace file is
phase 1's byte for byte, then times a generation of ``--generate`` tokens there. Prints one JSON
object and exits 1 when a check fails (or the time target is missed).

On one H200 (no network needed):

    python scripts/gpu_check.py                       # 61 blocks, 512 tokens, target 120 s; then the server

A CPU smoke test of the same path (the tests run it on a tiny config):

    python scripts/gpu_check.py --device cpu --n-layers 4 --tokens 8

Weights are generated when a block is reached (no read-ahead), so generation and compute are
timed apart: ``compute_seconds`` excludes weight generation, ``generation_seconds`` is only that.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tracing.startup import load_torch  # noqa: E402

load_torch()

import torch  # noqa: E402

from model.config import ModelArgs  # noqa: E402
from model.stream import Streamer  # noqa: E402
from tracing.cli.loading import open_synthetic  # noqa: E402
from tracing.cli.progress import stream_bar  # noqa: E402
from tracing.runner import TraceRequest  # noqa: E402
from tracing.runner import run as run_request  # noqa: E402
from tracing.sites import site_name  # noqa: E402

DEFAULT_CONFIG = REPO / "assets" / "configs" / "config_671B_hf.json"


def trace_sites(args: ModelArgs) -> list[str]:
    """The default trace sites (docs/architecture.md) for this config."""
    names = []
    for i in range(args.n_layers):
        names += [site_name(i, "resid_pre"), site_name(i, "resid_mid"), site_name(i, "resid_post")]
        names += [site_name(i, "attn.indexer.scores"), site_name(i, "attn.indexer.topk_indices")]
        if args.is_moe(i):
            names += [site_name(i, f"ffn.gate.{s}") for s in ("scores", "topk_indices", "topk_weights")]
    return names + ["logits.last"]


def check_trace(trace: dict[str, torch.Tensor], args: ModelArgs, n_tokens: int) -> list[str]:
    """Every way the recorded values break the trace contract, as sentences (empty: all good)."""
    problems: list[str] = []
    T, D, V = n_tokens, args.dim, args.vocab_size
    K, E, k = min(args.index_topk, T), args.n_routed_experts, args.n_activated_experts

    def expect(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        value = trace.get(name)
        if value is None:
            problems.append(f"{name}: not recorded")
        elif tuple(value.shape) != shape or value.dtype != dtype:
            problems.append(f"{name}: {list(value.shape)} {value.dtype}, expected {list(shape)} {dtype}")
        else:
            return value
        return None

    future = torch.ones(T, T, dtype=torch.bool).triu(1)  # key after query: masked
    for i in range(args.n_layers):
        stream = [expect(site_name(i, s), (T, D), torch.float32) for s in ("resid_pre", "resid_mid", "resid_post")]
        for s, value in zip(("resid_pre", "resid_mid", "resid_post"), stream, strict=True):
            if value is not None and not torch.isfinite(value).all():
                problems.append(f"layers.{i}.{s}: not finite")
        nxt = trace.get(site_name(i + 1, "resid_pre"))
        if stream[2] is not None and nxt is not None and not torch.equal(stream[2], nxt):
            problems.append(f"layers.{i}.resid_post differs from layers.{i + 1}.resid_pre")
        scores = expect(site_name(i, "attn.indexer.scores"), (T, T), torch.float32)
        if scores is not None:
            if not torch.isneginf(scores[future]).all():
                problems.append(f"layers.{i}.attn.indexer.scores: a future key is not -inf")
            if not torch.isfinite(scores[~future]).all():
                problems.append(f"layers.{i}.attn.indexer.scores: a visible key is not finite")
        topk = expect(site_name(i, "attn.indexer.topk_indices"), (T, K), torch.int64)
        if topk is not None:
            for t in range(T):
                row, n_visible = topk[t], min(t + 1, K)
                chosen = row[row >= 0]
                if len(chosen) != n_visible or not (row[n_visible:] == -1).all():
                    problems.append(f"layers.{i}.attn.indexer.topk_indices: row {t} has {len(chosen)} keys, expected {n_visible}")
                    break
                if (chosen > t).any() or len(set(chosen.tolist())) != len(chosen):
                    problems.append(f"layers.{i}.attn.indexer.topk_indices: row {t} selects a future or repeated key")
                    break
        if not args.is_moe(i):
            continue
        gate_scores = expect(site_name(i, "ffn.gate.scores"), (T, E), torch.float32)
        if gate_scores is not None and args.score_func == "sigmoid" and not ((gate_scores >= 0) & (gate_scores <= 1)).all():
            problems.append(f"layers.{i}.ffn.gate.scores: outside [0, 1]")
        idx = expect(site_name(i, "ffn.gate.topk_indices"), (T, k), torch.int64)
        if idx is not None:
            if ((idx < 0) | (idx >= E)).any():
                problems.append(f"layers.{i}.ffn.gate.topk_indices: an expert outside 0..{E - 1}")
            elif any(len(set(row)) != k for row in idx.tolist()):
                problems.append(f"layers.{i}.ffn.gate.topk_indices: an expert chosen twice for one token")
        weights = expect(site_name(i, "ffn.gate.topk_weights"), (T, k), torch.float32)
        if weights is not None and args.score_func == "sigmoid":
            total = torch.full((T,), float(args.route_scale))
            if not torch.allclose(weights.sum(-1), total, rtol=1e-5, atol=1e-5):
                problems.append(f"layers.{i}.ffn.gate.topk_weights: rows do not sum to route_scale {args.route_scale}")
    logits = expect("logits.last", (V,), torch.float32)
    if logits is not None and not torch.isfinite(logits).all():
        problems.append("logits.last: not finite")
    return problems


def run(opts: argparse.Namespace) -> dict:
    device = torch.device(opts.device)
    loaded = open_synthetic(opts.config, opts.n_layers, device, torch.bfloat16, stream=True, split=False)
    args = loaded.model.args
    ids = torch.randint(0, args.vocab_size, (opts.tokens,), generator=torch.Generator().manual_seed(opts.seed)).tolist()
    request = TraceRequest(token_ids=tuple(ids), record=("default",))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    progress = stream_bar(sys.stderr) if not opts.quiet else None
    streamer = Streamer(loaded.model, loaded.source, device, prefetch=opts.prefetch, synchronize=True, progress=progress)
    start = time.perf_counter()
    trace = run_request(loaded.model, request, extra={"checkpoint": loaded.label}, device=device, context=streamer)
    wall = time.perf_counter() - start
    stats = streamer.stats
    problems = check_trace(trace.tensors, args, opts.tokens)
    local_bytes = trace.to_bytes()

    per_block = []
    for name, unit in stats.units.items():
        if name == "norm":
            continue
        per_block.append(
            {
                "name": name,
                "compute_seconds": round(unit.compute_seconds, 4),
                "generation_seconds": round(unit.load_seconds, 4),
                "bytes": unit.bytes,
                "experts": unit.experts,
            }
        )
    compute = stats.compute_seconds
    full_size = args.n_layers == 61 and opts.tokens >= 512 and device.type == "cuda"
    max_seconds = opts.max_seconds if opts.max_seconds is not None else (120.0 if full_size else None)
    if max_seconds is not None and compute > max_seconds:
        problems.append(f"compute took {compute:.1f} s, over the {max_seconds:.0f} s target")
    blocks = [b["compute_seconds"] for b in per_block if b["name"].startswith("layers.")]
    summary = {
        "ok": not problems,
        "problems": problems,
        "config": str(opts.config),
        "n_layers": args.n_layers,
        "tokens": opts.tokens,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "prefetch": opts.prefetch,
        "wall_seconds": round(wall, 3),
        "compute_seconds": round(compute, 3),  # excludes weight generation
        "generation_seconds": round(stats.load_seconds, 3),
        "weight_bytes": stats.bytes_read,
        "generation_gbps": round(stats.bytes_read / stats.load_seconds / 1e9, 3) if stats.load_seconds else None,
        "compute_gbps": round(stats.bytes_read / compute / 1e9, 3) if compute else None,  # weights through the forward
        "block_seconds_mean": round(sum(blocks) / len(blocks), 4) if blocks else None,
        "block_seconds_max": round(max(blocks), 4) if blocks else None,
        "max_seconds": max_seconds,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "peak_resident_weight_bytes": stats.peak_resident_bytes,
        "peak_host_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "recorded_sites": len(trace.tensors),
        "contract_sites": sum(name in trace.tensors for name in trace_sites(args)),
        "logits_last_argmax": int(trace["logits.last"].argmax()),
        "per_block": per_block,
    }
    if opts.server:
        summary["server"] = server_phase(opts, request, local_bytes, problems)
        summary["ok"] = not problems
    return summary


def server_phase(opts: argparse.Namespace, request: TraceRequest, local_bytes: bytes, problems: list[str]) -> dict:
    """The same request through ``python -m tracing serve`` on the same synthetic weights (streamed):
    its trace file must be phase 1's; then a generation, timed."""
    from tracing.client import Client

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve = [sys.executable, "-m", "tracing", "serve", "--synthetic", str(opts.config), "--stream", "--device", opts.device]
    if opts.n_layers is not None:
        serve += ["--n-layers", str(opts.n_layers)]
    serve += ["--port", str(port), "--max-prompt-tokens", str(max(opts.tokens, 1)), "--max-seconds", "86400"]
    started = time.perf_counter()
    proc = subprocess.Popen(serve, cwd=REPO, env=os.environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out: dict = {}
    try:
        with Client(f"http://127.0.0.1:{port}", timeout=10) as client:
            while True:
                if proc.poll() is not None:
                    problems.append(f"the server stopped: {proc.stdout.read().decode()[-500:]}")
                    return out
                try:
                    out["health"] = client.health()
                    break
                except Exception:  # not up yet
                    time.sleep(0.5)
            out["start_seconds"] = round(time.perf_counter() - started, 2)
            t = time.perf_counter()
            served = client.trace_bytes(request)
            out["prefill_seconds"] = round(time.perf_counter() - t, 3)
            out["same_bytes_as_the_tracer"] = served == local_bytes
            if served != local_bytes:
                problems.append("the server's trace file differs from the Tracer's")
            if opts.generate:
                t = time.perf_counter()
                generated = client.trace(token_ids=request.token_ids, generate=opts.generate)
                seconds = time.perf_counter() - t
                out["generate_tokens"] = generated.extra["generation"]["generated"]
                out["generate_seconds"] = round(seconds, 3)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="config.json (default: the 671B config)")
    parser.add_argument("--n-layers", type=int, default=None, help="keep the first N blocks")
    parser.add_argument("--tokens", type=int, default=512, help="prompt length (random token ids)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefetch", action="store_true", help="generate the next block in a background thread")
    parser.add_argument("--max-seconds", type=float, default=None, help="fail when compute takes longer")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--no-server", dest="server", action="store_false", help="skip phase 2 (the model server)")
    parser.add_argument("--generate", type=int, default=2, help="tokens the server phase generates (each streams every block)")
    opts = parser.parse_args(argv)
    try:
        summary = run(opts)
    except Exception as exc:  # one JSON object whatever happens
        summary = {"ok": False, "problems": [f"{type(exc).__name__}: {exc}"], "traceback": traceback.format_exc()}
    text = json.dumps(summary, default=lambda v: None if isinstance(v, float) and math.isnan(v) else str(v))
    print(text)
    if opts.json is not None:
        opts.json.write_text(text + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
