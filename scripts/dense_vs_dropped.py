"""Why the dense-attention intervention and the dropped-key attribution differ, on the demo.

For each position: ``dropped`` (the sum over blocks of ``attn.attribution_dropped``: each block alone
attending over every causal key, read straight through the frozen final norm: a direct effect), the
dense run's change of the logit (``--dense-attention``, every block at once, everything downstream
recomputed: the total effect), each block made dense alone (the others keep their indexer's
selection), and the dense run's change split over the attributed parts of both runs (their
difference: attention and FFN parts, the embedding and the rest, which sum to the change exactly).

    python scripts/dense_vs_dropped.py [--checkpoint demo] [--tokens 90] [--positions 83,89]

The prompt is the first ``--tokens`` tokens of assets/demo/heldout_sample.txt (docs/attribution.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tracing.cli.loading import open_checkpoint  # noqa: E402
from tracing.runner import TraceRequest, run  # noqa: E402

DENSE = {"attention": "dense"}


def sparse_except(n_layers: int, block: int, k: int):
    """Hooks that, in a dense run, give every block but ``block`` its indexer's own top-k again (padded
    with -1 to the dense width): block ``block`` alone attends over every causal key."""

    def selection(j: int):
        def hook(value: torch.Tensor, ctx) -> torch.Tensor:
            scores = ctx.seen[f"layers.{j}.attn.indexer.scores"]  # (B, T, S), -inf where masked
            top, idx = torch.topk(scores, min(k, scores.shape[-1]), dim=-1)
            out = torch.full_like(value, -1)  # (B, T, S)
            out[..., : idx.shape[-1]] = idx.masked_fill(top == float("-inf"), -1)
            return out

        return hook

    return {f"layers.{j}.attn.indexer.topk_indices": selection(j) for j in range(n_layers) if j != block}


def parts(trace, n_layers: int) -> dict[str, float]:
    return {
        "total": float(trace["attribution.total"]),
        "attention": sum(float(trace.site(i, "attn.attribution").sum()) for i in range(n_layers)),
        "ffn": sum(float(trace.site(i, "ffn.attribution").sum()) for i in range(n_layers)),
        "embed+rest": float(trace["attribution.embed"].sum() + trace["attribution.rest"].sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default="demo")
    parser.add_argument("--tokens", type=int, default=90)
    parser.add_argument("--positions", default="83,89")
    args = parser.parse_args()
    loaded = open_checkpoint(args.checkpoint)
    model, tokenizer, n = loaded.model, loaded.tokenizer, loaded.model.args.n_layers
    text = (Path(__file__).resolve().parents[1] / "assets" / "demo" / "heldout_sample.txt").read_text()
    ids = tuple(tokenizer.encode(text)[: args.tokens])

    def traced(position: int, target: int | None = None, interventions=None, hooks=None):
        request = TraceRequest(token_ids=ids, attribute=True, position=position, target=target, interventions=interventions or {})
        return run(model, request, tokenizer, hooks=hooks)

    for position in (int(p) for p in args.positions.split(",")):
        sparse = traced(position)
        target = sparse.extra["attribution"]["target"]
        dense = traced(position, target, DENSE)
        dropped = [float(sparse.site(i, "attn.attribution_dropped").sum()) for i in range(n)]
        alone = [
            float(traced(position, target, DENSE, sparse_except(n, i, model.args.index_topk))["attribution.total"])
            - float(sparse["attribution.total"])
            for i in range(n)
        ]
        a, b = parts(sparse, n), parts(dense, n)
        moved = {name: b[name] - a[name] for name in a}
        print(f"position {position}, target {tokenizer.decode([target])!r}, logit {a['total']:+.3f}")
        print(f"  dropped keys (direct, per block): {' '.join(f'{v:+.3f}' for v in dropped)}; sum {sum(dropped):+.3f}")
        print(f"  dense, one block at a time (total): {' '.join(f'{v:+.3f}' for v in alone)}; sum {sum(alone):+.3f}")
        print(
            f"  dense, every block (total): {moved['total']:+.3f} = attention parts {moved['attention']:+.3f}"
            f" + FFN parts {moved['ffn']:+.3f} + embedding and rest {moved['embed+rest']:+.3f}"
        )


if __name__ == "__main__":
    main()
