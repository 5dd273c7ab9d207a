"""The model server against the same requests run in this process, on this machine.

    python scripts/bench_serve.py                       # demo and the mid-size synthetic model
    python scripts/bench_serve.py --models demo --requests 10

A benchmark run by hand, not a test; one JSON object on stdout. For each model:

* ``per_request``: one request (a prefill of the prompt, then the same with ``--generate``) through a
  1-process server (``python -m tracing serve``) against ``tracing.runner.run`` on a model loaded here,
  rounds interleaved; the target is server time <= 1.1 x in-process + 50 ms;
* ``one_load``: the server's start (the load) against its per-request time over ``--requests`` requests;
* ``concurrent`` (demo): 4 clients at once on a 2-rank gloo server (torchrun): every request answered,
  each with its own prompt's trace (the tokens and selections of that prompt run here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_forward as bf  # noqa: E402  (first: it starts torch as the entry points do)

# isort: split
import torch  # noqa: E402

from tests.tracing.test_server import start, stop  # noqa: E402
from tracing.cli.loading import open_checkpoint, open_synthetic  # noqa: E402
from tracing.client import Client  # noqa: E402
from tracing.runner import TraceRequest, run  # noqa: E402

PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "However little known the feelings or views of such a man may be on his first entering",
    "this truth is so well fixed in the minds of the surrounding families, that he is considered",
    "the rightful property of some one or other of their daughters. My dear Mr. Bennet, said his lady",
]


def mid_config(workdir: Path) -> Path:
    path = workdir / "bench-serve-mid.json"
    path.write_text(json.dumps(bf.BENCH_ARGS.replace(n_layers=4).to_hf()))
    return path


def requests_for(model: str, vocab: int, generate: int) -> dict[str, TraceRequest]:
    if model == "demo":
        return {"prefill": TraceRequest(prompt=PROMPTS[0]), "generate": TraceRequest(prompt=PROMPTS[0], generate=generate)}
    ids = tuple(torch.randint(2, vocab, (128,), generator=torch.Generator().manual_seed(0)).tolist())
    return {"prefill": TraceRequest(token_ids=ids), "generate": TraceRequest(token_ids=ids, generate=generate)}


def per_request(name: str, source: list[str], loaded, rounds: int, generate: int) -> dict:
    started = time.perf_counter()
    proc, url = start(source, env={"OMP_NUM_THREADS": str(torch.get_num_threads())})  # the threads this process has
    start_seconds = time.perf_counter() - started
    out = {"server_start_seconds": round(start_seconds, 2)}
    try:
        with Client(url) as client:
            for kind, request in requests_for(name, loaded.model.args.vocab_size, generate).items():
                here = lambda request=request: run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})  # noqa: E731
                there = lambda request=request: client.trace_bytes(request)  # noqa: E731
                here(), there()  # warm-up: weight copies, connections
                times = {"in_process": [], "server": []}
                for r in range(rounds):
                    for way in bf.rotated(list(times), r):
                        t = time.perf_counter()
                        (here if way == "in_process" else there)()
                        times[way].append(time.perf_counter() - t)
                a, b = statistics.median(times["in_process"]), statistics.median(times["server"])
                out[kind] = {
                    "in_process_s": round(a, 4),
                    "server_s": round(b, 4),
                    "ratio": round(b / a, 3),
                    "target_s": round(1.1 * a + 0.05, 4),
                    "met": b <= 1.1 * a + 0.05,
                }
            ten = [time.perf_counter()]
            for _ in range(10):
                client.trace_bytes(requests_for(name, loaded.model.args.vocab_size, generate)["prefill"])
                ten.append(time.perf_counter())
            each = (ten[-1] - ten[0]) / 10
            out["one_load"] = {
                "start_seconds": round(start_seconds, 2),
                "per_request_s": round(each, 4),
                "ten_requests_s": round(ten[-1] - ten[0], 3),
                "start_in_requests": round(start_seconds / each, 1),
            }
    finally:
        stop(proc)
    return out


def concurrent(checkpoint: str, loaded) -> dict:
    proc, url = start(["--checkpoint", checkpoint], ranks=2)
    results, errors = {}, []
    try:

        def client_run(i: int) -> None:
            try:
                with Client(url) as client:
                    t = time.perf_counter()
                    places = []
                    trace = client.trace(prompt=PROMPTS[i], generate=4, on_progress=lambda e: places.append(e.get("queued")))
                    results[i] = (trace, time.perf_counter() - t, max((p for p in places if p), default=0))
            except Exception as exc:  # noqa: BLE001
                errors.append(f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=client_run, args=(i,)) for i in range(4)]
        t = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        wall = time.perf_counter() - t
        correct = 0
        for i, (trace, _, _) in results.items():
            want = run(loaded.model, TraceRequest(prompt=PROMPTS[i], generate=4), loaded.tokenizer)
            same = torch.equal(trace["tokens"], want["tokens"]) and all(
                torch.equal(trace[n], want[n]) for n in want.tensors if n.endswith("topk_indices")
            )
            correct += same
        return {
            "clients": 4,
            "answered": len(results),
            "correct": correct,
            "errors": errors,
            "wall_s": round(wall, 3),
            "per_client_s": [round(results[i][1], 3) for i in sorted(results)],
            "highest_queue_place": max(r[2] for r in results.values()) if results else None,
        }
    finally:
        stop(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["demo", "mid"], choices=["demo", "mid"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--generate", type=int, default=8)
    opts = parser.parse_args()
    torch.set_num_threads(2)
    result: dict = {
        "benchmark": "the model server against the same request in this process",
        "environment": {"torch": torch.__version__, "cpu": bf.cpu_name(), "load_average_start": bf.load_average()},
        "results": {},
    }
    for name in opts.models:
        bf.log(f"{name}: per request and one load")
        if name == "demo":
            loaded, source = open_checkpoint("demo"), ["--checkpoint", "demo"]
        else:
            config = mid_config(Path("/tmp"))
            loaded, source = open_synthetic(config), ["--synthetic", str(config)]
        result["results"][name] = per_request(name, source, loaded, opts.rounds, opts.generate)
        if name == "demo":
            bf.log("demo: 4 concurrent clients on a 2-rank server")
            result["results"]["demo"]["concurrent_two_ranks"] = concurrent("demo", loaded)
    result["environment"]["load_average_end"] = bf.load_average()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
