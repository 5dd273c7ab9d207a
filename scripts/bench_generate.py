"""Decode speed: milliseconds per generated token, traced and untraced, against transformers' generate.

    python scripts/bench_generate.py                     # prompts of 64 and 512 tokens, 32 new tokens
    python scripts/bench_generate.py --prompts 64 --new 16

A benchmark run by hand, not a test; one JSON object on stdout. The weights are bench_forward's
mid-size config (hidden 1024, 8 blocks, 64 experts; the demo's 256-position context cannot hold a
512-token prompt), as the FP8 checkpoint for ours and its exact bf16 dequantisation for the peer.

Per prompt length P, each way is timed as (time to prefill P and generate N greedy tokens - time to
prefill P and generate none) / N, so the prefill cancels and what is left is the decode step:

* ``ours``        -- the model's own decode loop over its caches (``model(token, start_pos, cache)``);
* ``ours_traced`` -- ``tracing.runner.trace_tokens(generate=N)`` with the default sites;
* ``peer``        -- ``DeepseekV32ForCausalLM.generate(max_new_tokens=N)`` with its KV cache.

Targets: traced at most 1.2x untraced; untraced at least as fast as the peer. A decode step costs
O(cache length): the figure at P = 512 against P = 64 shows it is not a re-run of the prefix.
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_forward as bf  # noqa: E402

from model import ops  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from tracing.runner import trace_tokens  # noqa: E402


def ours(model, ids: list[int], new: int) -> None:
    cache = model.new_cache()
    logits = model(torch.tensor([ids]), cache=cache)
    for pos in range(len(ids), len(ids) + new):
        token = int(logits[0].argmax())
        logits = model(torch.tensor([[token]]), start_pos=pos, cache=cache)


def timed(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--new", type=int, default=32, help="tokens generated per run (default 32)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    args = bf.BENCH_ARGS
    workdir = Path(tempfile.gettempdir()) / f"dsv32-bench-forward-{bf.config_key(args, bf.SEED)}"
    ckpt = bf.make_checkpoints(args, workdir, bf.SEED)
    model = load_model(ckpt["fp8"], dtype=torch.bfloat16)
    peer = None if opts.no_peer else bf.load_peer(Path(ckpt["bf16"]), torch.bfloat16)[0]
    gen = torch.Generator().manual_seed(bf.SEED)
    result: dict = {
        "benchmark": "ms per generated token (greedy, batch 1, bfloat16, CPU)",
        "environment": {
            "torch": torch.__version__,
            "cpu": bf.cpu_name(),
            "cpu_products": ops.describe_cpu_route(),
            "threads": torch.get_num_threads(),
        },
        "new_tokens": opts.new,
        "results": {},
    }
    for prompt in opts.prompts:
        ids = torch.randint(2, args.vocab_size, (prompt,), generator=gen).tolist()
        ways = {
            "ours": lambda n, ids=ids: ours(model, ids, n),
            "ours_traced": lambda n, ids=ids: trace_tokens(model, ids, generate=n),
        }
        if peer is not None:
            x = torch.tensor([ids])
            ways["peer"] = lambda n, x=x: peer.generate(x, max_new_tokens=max(n, 1), min_new_tokens=max(n, 1), do_sample=False)
        cell = {}
        with torch.inference_mode():
            for name, fn in ways.items():
                fn(2)  # warm-up: weight copies, allocator
                base = 1 if name == "peer" else 0  # generate() makes at least one token
                full, short = timed(lambda fn=fn: fn(opts.new), opts.rounds), timed(lambda fn=fn, b=base: fn(b), opts.rounds)
                cell[name] = round((full - short) / (opts.new - base) * 1e3, 2)
                bf.log(f"P={prompt} {name}: {cell[name]} ms per token")
        cell["traced_over_untraced"] = round(cell["ours_traced"] / cell["ours"], 3)
        if "peer" in cell:
            cell["peer_over_ours"] = round(cell["peer"] / cell["ours"], 3)
        result["results"][str(prompt)] = cell
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
