"""Atlas throughput against plain untraced prefill on the same batches (issue 15: at least 0.8x).

    python scripts/bench_atlas.py                        # the demo and the mid-size synthetic config
    python scripts/bench_atlas.py --cases demo --rounds 9

A benchmark run by hand, not a test; it prints one JSON object on stdout (progress on stderr).

Cases:

* ``demo``: the bundled checkpoint on its held-out sample (assets/demo/heldout_sample.txt, read
  ``--copies`` times), cut by tracing.atlas.corpus into sequences of 256 positions, batches of 8.
* ``mid``: scripts/bench_forward.py's mid-size config (hidden 1024, 8 blocks, 64 routed experts,
  k = 6, index_topk 256) with synthetic FP8 weights, random token ids, sequences of 512, batches of 2.

Per round every batch runs once plain (``model(ids)`` under inference_mode, no hooks) and once as
the atlas runs it (tracing.atlas.counts.AtlasCounts hooked on the model: ``begin``, the forward,
``commit``), back to back, the order alternating from batch to batch, so background load falls on
both alike; one warm-up round first. ``ratio`` is the median over rounds of plain time / atlas
time (the atlas's share of the plain tokens/s; target >= 0.8), ``ratio_cpu_time`` the same on the
process's CPU seconds (steadier on a shared machine). For the demo, ``end_to_end`` also times
tracing.atlas.AtlasJob.run over the same corpus (the loop, the corpus read again, the final tables
and files; not the survey or the model's loading) against the plain loop, alternately, 3 times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from tracing.startup import load_torch  # noqa: E402

load_torch()  # first: torch's idle OpenMP threads sleep (tracing.startup)

from model import ModelArgs  # noqa: E402

# isort: split
import torch  # noqa: E402
from bench_forward import BENCH_ARGS, cpu_name, load_average  # noqa: E402

from model import kernels  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from model.synthetic import SyntheticSource  # noqa: E402
from tracing.atlas import AtlasJob  # noqa: E402
from tracing.atlas.corpus import Corpus, Source  # noqa: E402
from tracing.atlas.counts import AtlasCounts  # noqa: E402
from tracing.cli.loading import DEMO, Loaded, open_checkpoint  # noqa: E402

SAMPLE = DEMO / "heldout_sample.txt"


def log(msg: str) -> None:
    print(f"[bench_atlas {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def demo_case(copies: int) -> tuple[Loaded, list[torch.Tensor], dict]:
    loaded = open_checkpoint("demo")
    corpus = Corpus([Source(SAMPLE)] * copies, loaded.tokenizer, 256, 8)
    batches = [torch.tensor(b, dtype=torch.long) for b in corpus.batches()]
    return loaded, batches, {"seq_len": 256, "batch_size": 8, "corpus": f"{SAMPLE.relative_to(REPO)} x {copies}"}


def mid_case(n_batches: int) -> tuple[Loaded, list[torch.Tensor], dict]:
    args: ModelArgs = BENCH_ARGS
    model = load_model(SyntheticSource(args, seed=0))
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, args.vocab_size, (2, 512), generator=gen) for _ in range(n_batches)]
    loaded = Loaded(model, None, None, "synthetic:bench_forward.BENCH_ARGS", torch.device("cpu"))
    return loaded, batches, {"seq_len": 512, "batch_size": 2, "corpus": f"{n_batches} batches of random ids"}


def time_rounds(model, batches: list[torch.Tensor], seq_len: int, rounds: int) -> dict:
    """Each batch plain and as the atlas runs it, back to back (the order alternating by batch and
    round), so a change in the machine's load falls on both; wall and process CPU seconds."""
    counts = AtlasCounts(model.args, seq_len)

    def plain(ids: torch.Tensor) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        model(ids)
        return time.perf_counter() - wall, time.process_time() - cpu

    def atlas(ids: torch.Tensor) -> tuple[float, float]:
        with counts.watch(model):  # the hooks stay on for a whole run: attached outside the timing
            wall, cpu = time.perf_counter(), time.process_time()
            counts.begin(ids)
            model(ids)
            counts.commit()
            return time.perf_counter() - wall, time.process_time() - cpu

    tokens = sum(b.numel() for b in batches)
    wall: dict[str, list[float]] = {"plain": [], "atlas": []}
    cpu: dict[str, list[float]] = {"plain": [], "atlas": []}
    with torch.inference_mode():
        for ids in batches:  # warm-up: caches of dequantised weights, the allocator
            plain(ids), atlas(ids)
        for r in range(rounds):
            spent = {name: [0.0, 0.0] for name in wall}
            for b, ids in enumerate(batches):
                for name, fn in (("plain", plain), ("atlas", atlas))[:: 1 if (r + b) % 2 == 0 else -1]:
                    w, c = fn(ids)
                    spent[name][0] += w
                    spent[name][1] += c
            for name, (w, c) in spent.items():
                wall[name].append(w)
                cpu[name].append(c)
            log(f"round {r + 1}/{rounds}: plain {wall['plain'][-1]:.2f} s, atlas {wall['atlas'][-1]:.2f} s")
    ratios = [p / a for p, a in zip(wall["plain"], wall["atlas"], strict=True)]
    cpu_ratios = [p / a for p, a in zip(cpu["plain"], cpu["atlas"], strict=True)]
    return {
        "tokens_per_round": tokens,
        "plain_tokens_per_s": round(tokens / statistics.median(wall["plain"]), 1),
        "atlas_tokens_per_s": round(tokens / statistics.median(wall["atlas"]), 1),
        "ratio": round(statistics.median(ratios), 3),
        "ratio_cpu_time": round(statistics.median(cpu_ratios), 3),
        "ratio_per_round": [round(x, 3) for x in ratios],
        "seconds": {k: [round(x, 3) for x in v] for k, v in wall.items()},
        "cpu_seconds": {k: [round(x, 3) for x in v] for k, v in cpu.items()},
    }


def end_to_end(loaded: Loaded, copies: int, reps: int = 3) -> dict:
    """AtlasJob.run over the corpus (the loop, its bookkeeping, the final tables and files) and the
    plain loop over the same batches, alternately ``reps`` times; the survey is not timed."""
    sources = [Source(SAMPLE)] * copies
    job_s, plain_s, tokens = [], [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(reps):
            job = AtlasJob(sources, loaded.tokenizer, loaded.model.args, Path(tmp) / str(rep), seq_len=256, batch_size=8)
            start = time.perf_counter()
            tokens = job.run(loaded)["tokens"]
            job_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            with torch.inference_mode():
                for batch in job.corpus.batches():
                    loaded.model(torch.tensor(batch, dtype=torch.long))
            plain_s.append(time.perf_counter() - start)
    return {
        "tokens": tokens,
        "atlas_tokens_per_s": round(tokens / statistics.median(job_s), 1),
        "plain_tokens_per_s": round(tokens / statistics.median(plain_s), 1),
        "ratio": round(statistics.median(p / a for p, a in zip(plain_s, job_s, strict=True)), 3),
        "seconds": {"atlas": [round(x, 3) for x in job_s], "plain": [round(x, 3) for x in plain_s]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="demo,mid", help="comma-separated: demo, mid")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--copies", type=int, default=4, help="demo: times the held-out sample is read (4: 20 sequences)")
    parser.add_argument("--mid-batches", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    result: dict = {
        "benchmark": "atlas tokens/s against plain prefill tokens/s on the same batches, CPU",
        "environment": {
            "torch": torch.__version__,
            "cpu": cpu_name(),
            "cpu_route": kernels.describe_route(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "omp_env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS")},
            "load_average_start": load_average(),
        },
        "cases": {},
    }
    for case in [c.strip() for c in opts.cases.split(",") if c.strip()]:
        log(f"case {case}: loading")
        loaded, batches, info = demo_case(opts.copies) if case == "demo" else mid_case(opts.mid_batches)
        info["config"] = loaded.model.args.to_reference()
        info.update(time_rounds(loaded.model, batches, info["seq_len"], opts.rounds))
        if case == "demo":
            info["end_to_end"] = end_to_end(loaded, opts.copies)
        result["cases"][case] = info
        rates = f"plain {info['plain_tokens_per_s']} tokens/s, atlas {info['atlas_tokens_per_s']}"
        log(f"case {case}: ratio {info['ratio']} ({rates})")
        del loaded, batches
    result["environment"]["load_average_end"] = load_average()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    with kernels.serial_passes():  # our forwards under the thread policy, as the command line runs them
        main()
