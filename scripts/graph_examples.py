"""The intervention graphs of docs/examples, made on the bundled demo (docs/graphs.md):

    python scripts/graph_examples.py            # writes docs/examples/{steering,mean_ablation}.json (+ .safetensors)

``steering``: the demo's block-1 residual stream, mean over a glad sentence less its mean over a sad
one (BOS left out), added at twice its size to every position but BOS entering block 2, during
generation too. ``mean_ablation``: block 1's attention update replaced, at every position but BOS,
by its mean over those positions (the positions so far, at each decode step), and that mean saved.
The test suite builds them again and checks the shipped files are these.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tracing.analyses.graph import Graph, mean_difference  # noqa: E402

EXAMPLES = REPO / "docs" / "examples"
STEER_SITE = "layers.1.resid_post"  # the direction is read here ...
STEER_INTO = "layers.2.resid_pre"  # ... and added here (the same stream, entering the next block)
GLAD = "She was happy, glad and full of joy and delight."
SAD = "She was sad, miserable and full of grief and sorrow."
STRENGTH = 2.0


def steering(loaded) -> Graph:
    glad, sad = (loaded.run(prompt, record=STEER_SITE) for prompt in (GLAD, SAD))
    g = Graph()
    direction = g.constant(mean_difference(glad, sad, STEER_SITE), name="direction")
    g.add(STEER_INTO, direction * STRENGTH, positions="1:")
    return g


def mean_ablation() -> Graph:
    g = Graph()
    update = g.read("layers.1.attn_out", positions="1:")
    mean = update.mean()
    g.replace("layers.1.attn_out", mean, positions="1:")
    g.save("attn_out_mean", mean)
    return g


def main() -> None:
    import tracing

    demo = tracing.load("demo")
    EXAMPLES.mkdir(exist_ok=True)
    print(steering(demo).save_file(EXAMPLES / "steering.json"))
    print(mean_ablation().save_file(EXAMPLES / "mean_ablation.json"))


if __name__ == "__main__":
    main()
