"""A fixed set of traces through the command line, to show a change leaves every recorded bit as it was.

    python scripts/trace_fixtures.py write DIR [--only tiny,demo,mid,v3]   # every run below into DIR
    python scripts/trace_fixtures.py compare OLD NEW                   # tensor by tensor, bit for bit

Run ``write`` on the tree before a change (a ``git worktree`` of the old commit, with this script
copied in) and on the tree after it, then ``compare``. The runs go through ``python -m tracing
run`` only (the command line is a contract both trees keep), on four models: the tiny config and a
mid-size one (widths of the FP8 block, 64 experts in 8 groups) as synthetic FP8 weights, the tiny
config in DeepSeek-V3's layout (no indexer, V3's arithmetic) as a synthetic checkpoint directory
(``model.synthetic.write_synthetic_checkpoint``, written once into ``--configs`` for both trees),
and the bundled demo with its tokenizer; in each of three numerics: bfloat16 on the CPU's own route,
bfloat16 through float32 products (``ANATOMY_CPU_BF16=float32``), float32 activations. Modes: the
default prefill, ``--prefill``, greedy and sampled ``--generate``, ``--attribute`` with the
contribution graph, ``--record all``, interventions (without the indexer's on the V3 layout, which
refuses them), and ``--stream``.

``compare`` prints one JSON line per run (equal, or the differing tensors with their largest
difference) and a summary; it exits 1 when a bfloat16 run differs in any bit, or a float32 run in a
selection or by more than ``--f32-tol`` (float32 products may round by thread count).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path.cwd()

MID = {  # the mid-size benchmark's architecture (scripts/bench_forward.py), cut to 4 blocks
    "vocab_size": 16384,
    "dim": 1024,
    "inter_dim": 2816,
    "moe_inter_dim": 256,
    "n_layers": 4,
    "n_dense_layers": 1,
    "n_heads": 8,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "n_activated_experts": 6,
    "n_expert_groups": 8,
    "n_limited_groups": 4,
    "score_func": "sigmoid",
    "route_scale": 2.5,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_seq_len": 4096,
    "original_seq_len": 4096,
    "rope_factor": 1.0,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 64,
    "dtype": "fp8",
    "scale_fmt": "ue8m0",
}
PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of "
    "a wife. However little known the feelings or views of such a man may be"
)
NUMERICS = {
    "bf16": ({}, "bfloat16"),
    "bf16-f32route": ({"ANATOMY_CPU_BF16": "float32"}, "bfloat16"),
    "f32": ({}, "float32"),
}


def _ids(n: int, vocab: int, seed: int) -> str:
    state, out = seed, []
    for _ in range(n):  # a small LCG: the same ids in every tree, no torch needed
        state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
        out.append(2 + (state >> 33) % (vocab - 2))
    return ",".join(map(str, out))


def _models(workdir: Path, only: list[str]) -> dict[str, list[str]]:
    tiny = workdir / "tiny.json"
    mid = workdir / "mid.json"
    v3 = workdir / "tiny-v3"
    if (not only or "v3" in only) and not (v3 / "config.json").exists():  # a tree from before the layout need not run it
        code = (
            "import sys; from model import TINY; from model.synthetic import v3_layout, write_synthetic_checkpoint; "
            "write_synthetic_checkpoint(sys.argv[1], v3_layout(TINY))"
        )
        subprocess.run([sys.executable, "-c", code, str(v3)], check=True, cwd=REPO)
    if not tiny.exists():
        code = (
            "import json,sys; from model import TINY; from model.config import ModelArgs; "
            "json.dump(TINY.to_hf(), open(sys.argv[1], 'w')); "
            "json.dump(ModelArgs(**json.loads(sys.argv[3])).to_hf(), open(sys.argv[2], 'w'))"
        )
        subprocess.run([sys.executable, "-c", code, str(tiny), str(mid), json.dumps(MID)], check=True, cwd=REPO)
    return {
        "tiny": ["--synthetic", str(tiny), "--token-ids", _ids(40, 512, 1)],
        "demo": ["--checkpoint", "demo", "--prompt", PROMPT],
        "mid": ["--synthetic", str(mid), "--token-ids", _ids(96, MID["vocab_size"], 2)],
        "v3": ["--checkpoint", str(v3), "--token-ids", _ids(40, 512, 3)],
    }


INTERVENTIONS = ["--no-gate-bias", "--ablate-heads", "1:0", "--zero-experts", "2:3"]
MODES = {
    "prefill": [],
    "decode": ["--prefill", "30"],
    "generate": ["--generate", "6"],
    "sampled": ["--generate", "4", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3"],
    "attribute": ["--attribute", "--record", "default,flow"],
    "attribute-decode": ["--attribute", "--prefill", "30", "--record", "default,layers.*.attn.attribution_src"],
    "all": ["--record", "all"],
    "interventions": [*INTERVENTIONS, "--index-topk", "8"],
    "stream": ["--stream"],
}
NO_INDEXER = {"interventions": INTERVENTIONS}  # the V3 layout refuses the indexer's


def write(directory: Path, only: list[str], configs: Path) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    configs.mkdir(parents=True, exist_ok=True)
    models = _models(configs, only)  # one place for both trees: the traces name the config file
    failed = 0
    for model, source in models.items():
        if only and model not in only:
            continue
        for numerics, (env, dtype) in NUMERICS.items():
            for mode, flags in (MODES | NO_INDEXER if model == "v3" else MODES).items():
                if mode == "all" and model == "mid":
                    continue  # per-head probabilities of 96 positions x 4 blocks: large, and "all" is covered twice
                out = directory / f"{model}-{numerics}-{mode}.safetensors"
                cmd = [sys.executable, "-m", "tracing", "run", *source, "--dtype", dtype, *flags, "--out", str(out)]
                started = time.perf_counter()
                done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True)
                seconds = time.perf_counter() - started
                status = "ok" if done.returncode == 0 else f"exit {done.returncode}: {done.stderr.strip()[-300:]}"
                failed += done.returncode != 0
                print(f"{out.name}: {status} ({seconds:.1f} s)", file=sys.stderr, flush=True)
    return 1 if failed else 0


def compare(old: Path, new: Path, f32_tol: float) -> int:
    import torch
    from safetensors import safe_open

    def read(path: Path):
        with safe_open(str(path), framework="pt") as f:
            return f.metadata(), {name: f.get_tensor(name) for name in f.keys()}

    bad, runs, tensors = 0, 0, 0
    for path in sorted(old.glob("*.safetensors")):
        other = new / path.name
        if not other.exists():
            print(json.dumps({"run": path.stem, "missing": str(other)}))
            bad += 1
            continue
        (meta_a, a), (meta_b, b) = read(path), read(other)
        runs += 1
        exact = "-f32" not in path.stem or "f32route" in path.stem
        differing = {}
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                differing[name] = "only in " + ("old" if name in a else "new")
                continue
            x, y = a[name], b[name]
            tensors += 1
            if x.shape != y.shape or x.dtype != y.dtype:
                differing[name] = f"{list(x.shape)} {x.dtype} vs {list(y.shape)} {y.dtype}"
            elif not torch.equal(
                x.view(torch.uint8) if x.is_floating_point() else x, y.view(torch.uint8) if y.is_floating_point() else y
            ):
                if x.is_floating_point():
                    finite = torch.isfinite(x) & torch.isfinite(y)
                    gap = float((x[finite] - y[finite]).abs().max()) if finite.any() else float("nan")
                    same_mask = bool(torch.equal(torch.isfinite(x), torch.isfinite(y)))
                    differing[name] = {
                        "max_abs": gap,
                        "nonfinite_same": same_mask,
                        "rel": gap / max(float(x[finite].abs().max()), 1e-30) if finite.any() else None,
                    }
                else:
                    differing[name] = {"moved": int((x != y).sum())}
        meta = {k for k in set(meta_a) | set(meta_b) if meta_a.get(k) != meta_b.get(k)}
        failing = (
            exact
            and (differing or meta)
            or not exact
            and (
                meta
                or any(
                    not isinstance(d, dict) or "moved" in d or not d["nonfinite_same"] or d["max_abs"] > f32_tol
                    for d in differing.values()
                )
            )
        )
        bad += bool(failing)
        print(json.dumps({"run": path.stem, "equal": not differing and not meta, "metadata": sorted(meta), "tensors": differing}))
    print(json.dumps({"runs": runs, "tensors": tensors, "failing_runs": bad}))
    return 1 if bad else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write")
    w.add_argument("directory", type=Path)
    w.add_argument("--only", default="", help="comma-separated: tiny, demo, mid, v3")
    w.add_argument(
        "--configs", type=Path, default=Path("/tmp/anatomy-fixture-configs"), help="where the configs and the V3 checkpoint go"
    )
    c = sub.add_parser("compare")
    c.add_argument("old", type=Path)
    c.add_argument("new", type=Path)
    c.add_argument("--f32-tol", type=float, default=1e-5)
    args = parser.parse_args()
    if args.command == "write":
        return write(args.directory, [m for m in args.only.split(",") if m], args.configs)
    return compare(args.old, args.new, args.f32_tol)


if __name__ == "__main__":
    sys.exit(main())
