"""What the attribution and the contribution graph cost: a traced prefill with the default sites,
with ``--attribute`` (the parts, each head's sources, the per-expert logit lens), with the graph
(``--record default,flow``) and with both, as seconds and as ratios to the default trace.

    python scripts/bench_attribution.py                    # the demo: T = 128 (trained), 128 and 512 (its
                                                           # architecture, synthetic weights, context raised)
    python scripts/bench_attribution.py --synthetic assets/configs/config_671B_hf.json --n-layers 1 \\
        --tokens 128,512 --reps 1                          # real width, one block
    python scripts/bench_attribution.py --causal 5         # the causal check: parts against ablations

A benchmark run by hand, not a test; it prints one JSON object on stdout (progress on stderr).
Variants are timed per round in an order rotated from round to round (one warm-up first); each
figure is the median over rounds. The demo's context is 256 positions: T = 512 runs its
architecture with synthetic weights and max_seq_len raised, which does the same work per site.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tracing.startup import load_torch  # noqa: E402

load_torch()  # first: torch's idle OpenMP threads sleep (tracing.startup)

from model import ModelArgs  # noqa: E402

# isort: split
import torch  # noqa: E402

from model.checkpoint import load_model  # noqa: E402
from model.synthetic import SyntheticSource, truncate_layers  # noqa: E402
from tracing.analyses.attribution import AttributionRequest  # noqa: E402
from tracing.cli.loading import DEMO  # noqa: E402
from tracing.runner import trace_tokens  # noqa: E402

VARIANTS = {
    "default": {"record": "default"},
    "attribute": {"record": "default", "attribution": AttributionRequest()},
    "flow": {"record": "default,flow"},
    "attribute_flow": {"record": "default,flow", "attribution": AttributionRequest()},
}


def log(msg: str) -> None:
    print(f"[bench_attribution {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def models(opts) -> list[tuple[str, torch.nn.Module, list[int]]]:
    """(label, model, token counts) to measure."""
    tokens = [int(t) for t in opts.tokens.split(",")]
    if opts.synthetic:
        args = (
            truncate_layers(ModelArgs.from_file(opts.synthetic), opts.n_layers)
            if opts.n_layers
            else ModelArgs.from_file(opts.synthetic)
        )
        label = f"synthetic {Path(opts.synthetic).name}, {args.n_layers} block(s)"
        return [(label, load_model(SyntheticSource(args, seed=0)), tokens)]
    demo = ModelArgs.from_file(DEMO / "config.json")
    out = [("the demo (trained)", load_model(DEMO), [t for t in tokens if t <= demo.max_seq_len])]
    longest = max(tokens)
    wide = demo.replace(max_seq_len=longest, original_seq_len=longest)
    out.append(("the demo's architecture, synthetic weights", load_model(SyntheticSource(wide, seed=0)), tokens))
    return out


def measure(model, n_tokens: int, reps: int) -> dict:
    ids = torch.randint(2, model.args.vocab_size, (n_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    names = list(VARIANTS)
    times: dict[str, list[float]] = {n: [] for n in names}

    def run(name: str) -> float:
        start = time.perf_counter()
        trace = trace_tokens(model, ids, **VARIANTS[name])
        run.bytes[name] = sum(t.numel() * t.element_size() for t in trace.tensors.values())
        return time.perf_counter() - start

    run.bytes = {}
    for name in names:  # warm-up: the FP8 weight caches are built on the first forward
        run(name)
    for r in range(reps):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(run(name))
    median = {n: statistics.median(v) for n, v in times.items()}
    return {
        n: {
            "seconds": round(median[n], 4),
            "ratio": round(median[n] / median["default"], 3),
            "trace_mb": round(run.bytes[n] / 2**20, 2),
        }
        for n in names
    }


def causal(top: int) -> dict:
    """On the demo: for each prompt, the ``top`` heads and routed experts of largest |part|, each
    removed alone at the attributed position (tracing.analyses.causal, like with like), and for
    comparison at every position: its direct part against the measured effect on the target logit
    (the plain logit less the logit without the part; equal to the part when nothing downstream reacts)."""
    from tests.tracing.analyses.test_attribution import CAUSAL_PROMPTS
    from tracing.analyses.causal import causal_check
    from tracing.runner import TraceRequest, run
    from tracing.tokenizer import Tokenizer

    model, tokenizer = load_model(DEMO), Tokenizer(DEMO)
    rows = []
    for prompt in CAUSAL_PROMPTS:
        plain = run(model, TraceRequest(prompt=prompt, attribute=True), tokenizer)
        target = plain.extra["attribution"]["target"]
        table = causal_check(lambda r: run(model, r, tokenizer), TraceRequest(prompt=prompt, attribute=True), top, plain)
        for part in table.itertuples():
            key = "ablate_heads" if part.kind == "head" else "zero_experts"
            spec = {key: f"{part.block}:{part.index}"}
            everywhere = run(model, TraceRequest(prompt=prompt, attribute=True, target=target, interventions=spec), tokenizer)
            rows.append(
                {
                    "prompt": prompt,
                    "what": f"{key} {part.block}:{part.index}",
                    "part": round(part.attributed, 4),
                    "effect_at_position": round(part.effect, 4),
                    "effect_everywhere": round(table.attrs["total"] - float(everywhere["attribution.total"][0]), 4),
                }
            )
    largest = [next(r for r in rows if r["prompt"] == p) for p in CAUSAL_PROMPTS]
    parts = torch.tensor([r["part"] for r in rows])
    out = {"n": len(rows)}
    for where in ("at_position", "everywhere"):
        effect = torch.tensor([r[f"effect_{where}"] for r in rows])
        out[where] = {
            "largest_agree": sum(r["part"] * r[f"effect_{where}"] > 0 for r in largest),
            "all_agree": int((parts * effect > 0).sum()),
            "correlation": round(float(torch.corrcoef(torch.stack([parts, effect]))[0, 1]), 3),
            "median_effect_over_part": round(float((effect / parts).median()), 3),
        }
    out["rows"] = rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--synthetic", help="a config file: synthetic weights of that architecture")
    parser.add_argument("--n-layers", type=int, help="with --synthetic: its first N blocks")
    parser.add_argument("--tokens", default="128,512")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--causal", type=int, metavar="N", help="instead: the causal check on the demo, N parts per prompt")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    if opts.causal:
        print(json.dumps(causal(opts.causal), indent=1))
        return
    out = {"threads": opts.threads, "cpu": os.uname().machine, "load_average_start": list(os.getloadavg()), "runs": []}
    for label, model, tokens in models(opts):
        args = model.args
        for n in tokens:
            log(f"{label}: T={n}")
            result = {"model": label, "tokens": n, "dim": args.dim, "heads": args.n_heads, "blocks": args.n_layers}
            result["variants"] = measure(model, n, opts.reps)
            out["runs"].append(result)
    out["load_average_end"] = list(os.getloadavg())
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
