"""Decode speed: milliseconds per decode step, traced and untraced, against transformers' generate.

    python scripts/bench_generate.py                     # prompts of 64 and 512 tokens, 32 new tokens
    python scripts/bench_generate.py --prompts 64 --new 16 --rounds 5

A benchmark run by hand, not a test; one JSON object on stdout. The weights are bench_forward's
mid-size config (hidden 1024, 8 blocks, 64 experts; the demo's 256-position context cannot hold a
512-token prompt), as the FP8 checkpoint for ours and its exact bf16 dequantisation for the peer.

Per prompt length P, each way prefills P tokens and generates N greedy ones, and times itself: a
forward hook on the model marks the end of the prefill (its first forward call), and the run's
decode time is from there to the run's end, over the decode steps (forward calls) after it. The
prefill never enters, and no two noisy runs are subtracted. The ways:

* ``ours``        -- the model's own decode loop over its caches (``model(token, start_pos, cache)``);
* ``ours_traced`` -- ``tracing.runner.trace_tokens(generate=N)`` with the default sites (its time
  includes assembling the trace after the last step);
* ``peer``        -- ``DeepseekV32ForCausalLM.generate(max_new_tokens=N)`` with its KV cache.

Rounds run every way once each, in an order rotated per round, so background load falls on all
alike; reported are the medians of the ms per token and of the per-round ratios.

Targets: traced at most 1.2x untraced; untraced at least as fast as the peer. A decode step costs
O(cache length): the figure at P = 512 against P = 64 shows it is not a re-run of the prefix.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import bench_forward as bf  # noqa: E402  (first: it starts torch as the entry points do)

# isort: split
import torch  # noqa: E402

from model import kernels  # noqa: E402
from model.checkpoint import load_model  # noqa: E402
from tracing.runner import trace_tokens  # noqa: E402


def ours(model, ids: list[int], new: int) -> None:
    with kernels.serial_passes():  # as tracing.run enters it
        _ours(model, ids, new)


def _ours(model, ids: list[int], new: int) -> None:
    cache = model.new_cache()
    logits = model(torch.tensor([ids]), cache=cache)
    for pos in range(len(ids), len(ids) + new):
        token = int(logits[0].argmax())
        logits = model(torch.tensor([[token]]), start_pos=pos, cache=cache)


def decode_ms(model: torch.nn.Module, run) -> float:
    """ms per decode step of one ``run()``: from the end of its first forward call (the prefill)
    to the run's end, over the forward calls after it. (Ours feeds every generated token back;
    generate() does not feed the last, so it makes N tokens in N - 1 steps.)"""
    ends: list[float] = []
    handle = model.register_forward_hook(lambda *_: ends.append(time.perf_counter()))
    try:
        run()
        done = time.perf_counter()
    finally:
        handle.remove()
    if len(ends) < 2:
        raise RuntimeError(f"expected a prefill and decode steps, saw {len(ends)} forward calls")
    return (done - ends[0]) / (len(ends) - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--new", type=int, default=32, help="tokens generated per run (default 32, at least 2)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peer", action="store_true")
    opts = parser.parse_args()
    if opts.new < 2:
        parser.error("--new must be at least 2 (the peer's generate makes its first token in the prefill)")
    torch.set_num_threads(opts.threads)
    args = bf.BENCH_ARGS
    workdir = Path(tempfile.gettempdir()) / f"dsv32-bench-forward-{bf.config_key(args, bf.SEED)}"
    ckpt = bf.make_checkpoints(args, workdir, bf.SEED)
    model = load_model(ckpt["fp8"], dtype=torch.bfloat16)
    peer = None if opts.no_peer else bf.load_peer(Path(ckpt["bf16"]), torch.bfloat16)[0]
    gen = torch.Generator().manual_seed(bf.SEED)
    result: dict = {
        "benchmark": "ms per decode step (greedy, batch 1, bfloat16, CPU)",
        "environment": {
            "torch": torch.__version__,
            "cpu": bf.cpu_name(),
            **kernels.describe(),
            "threads": torch.get_num_threads(),
            "load_average_start": bf.load_average(),
        },
        "new_tokens": opts.new,
        "rounds": opts.rounds,
        "results": {},
    }
    n = opts.new
    for prompt in opts.prompts:
        ids = torch.randint(2, args.vocab_size, (prompt,), generator=gen).tolist()
        ways = {
            "ours": (model, lambda ids=ids: ours(model, ids, n)),
            "ours_traced": (model, lambda ids=ids: trace_tokens(model, ids, generate=n)),
        }
        if peer is not None:
            x = torch.tensor([ids])
            ways["peer"] = (peer, lambda x=x: peer.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False))
        times: dict[str, list[float]] = {name: [] for name in ways}
        names = list(ways)
        with torch.inference_mode():
            for _, run in ways.values():  # warm-up: weight copies, allocator
                run()
            for r in range(opts.rounds):
                for name in bf.rotated(names, r):
                    times[name].append(decode_ms(*ways[name]))
        cell = {name: round(statistics.median(t), 2) for name, t in times.items()}
        for name in names:
            bf.log(f"P={prompt} {name}: {cell[name]} ms per step ({', '.join(f'{t:.1f}' for t in times[name])})")
        cell["traced_over_untraced"] = bf.median_ratio(times["ours_traced"], times["ours"])
        if "peer" in cell:
            cell["peer_over_ours"] = bf.median_ratio(times["peer"], times["ours"])
        result["results"][str(prompt)] = cell
    result["environment"]["load_average_end"] = bf.load_average()
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
