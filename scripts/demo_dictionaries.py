"""Build the demo's bundled dictionaries (assets/dictionaries) and their card.

    python scripts/demo_dictionaries.py [--corpus /tmp/demo-corpus] [--work /tmp/demo-dictionaries]

The text is the demo model's own training corpus (scripts/demo_corpus.py fetches its two Debian
packages into ``--corpus``): ``DOCUMENTS`` of its documents drawn with a fixed seed, written as one
UTF-8 file. ``COMMANDS`` then train, with ``python -m tracing dictionary train``, a TopK sparse
autoencoder on the stream leaving block 1 (the input of block 2's router) and a transcoder of block
2's MoE FFN; each keeps cfg.json, sae_weights.safetensors and report.json (the training state is
not bundled). card.json holds the commands, the corpus and every figure of the reports; README.md
is rendered from it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

OUT = REPO / "assets" / "dictionaries"
DOCUMENTS = 16  # of the demo corpus's 661 training documents
SEED = 0
COMMON = "--features 1024 --k 16 --rows-per-step 512 --epochs 8 --dead-tokens 20000 --seed 0"
COMMANDS = {
    "layers.1.resid_post": "python -m tracing dictionary train --checkpoint demo --text-file {text} "
    "--site layers.1.resid_post " + COMMON + " --out {out}",
    "layers.2.ffn": "python -m tracing dictionary train --checkpoint demo --text-file {text} "
    "--site layers.2.ffn --kind transcoder " + COMMON + " --out {out}",
}
FIGURES = ("variance_explained", "l0", "dead_share", "clean_loss", "spliced_loss", "loss_increase", "train_seconds")


def corpus_text(corpus_dir: Path) -> str:
    import demo_corpus

    corpus = demo_corpus.build(demo_corpus.fetch(corpus_dir))
    rng = random.Random(SEED)
    chosen = sorted(rng.sample(range(len(corpus.train)), DOCUMENTS))
    return "\n\n".join(corpus.train[i] for i in chosen)


def render(card: dict) -> str:
    lines = [
        "# The demo's dictionaries",
        "",
        "Two TopK sparse dictionaries for the bundled demo model (assets/demo), in SAELens's format "
        "(`cfg.json` and `sae_weights.safetensors` per directory, docs/dictionaries.md), so the features "
        "of a trace are there without training. Built by `python scripts/demo_dictionaries.py`.",
        "",
        f"Text: {card['corpus']['documents']} of the demo's training documents (scripts/demo_corpus.py), "
        f"drawn with seed {card['corpus']['seed']}: {card['corpus']['characters']:,} characters, sha256 "
        f"`{card['corpus']['sha256'][:16]}…`. A tenth of its batches is held out for the figures below.",
        "",
        "| directory | reads | kind | features | k | variance explained | L0 | dead | loss clean → spliced (nats) | training |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, entry in card["dictionaries"].items():
        r = entry["report"]
        lines.append(
            f"| `{name}` | `{r['site']}` | {r['kind']} | {r['features']} | {r['k']} | {r['variance_explained']:.3f} | "
            f"{r['l0']:.1f} | {r['dead_share']:.1%} | {r['clean_loss']:.3f} → {r['spliced_loss']:.3f} "
            f"(+{r['loss_increase']:.3f}) | {r['steps']} steps, {r['train_seconds']:.0f} s |"
        )
    lines += ["", "Commands (`{text}`: the text above):", ""]
    for name, entry in card["dictionaries"].items():
        lines += [f"- `{name}`: `{entry['command']}`"]
    lines += [
        "",
        f"Machine: {card['machine']}. The training time includes gathering the activations "
        "(the model's forward passes up to the site) and is the wall time of a shared machine.",
        "",
    ]
    return "\n".join(lines)


def rerender(out: Path = OUT) -> None:
    """README.md again from card.json (no training)."""
    card = json.loads((out / "card.json").read_text(encoding="utf-8"))
    (out / "README.md").write_text(render(card), encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="/tmp/demo-corpus", help="scripts/demo_corpus.py's cache of the two packages")
    parser.add_argument("--work", default="/tmp/demo-dictionaries", help="where the text and the runs go")
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--machine", default="2-core AMD EPYC (AVX, FMA; no AVX2, AVX-512 or bf16), torch 2.13.0+cpu")
    opts = parser.parse_args()
    from tracing.cli.commands import main as cli

    work, out = Path(opts.work), Path(opts.out)
    work.mkdir(parents=True, exist_ok=True)
    text = corpus_text(Path(opts.corpus))
    path = work / "dictionary_corpus.txt"
    path.write_text(text, encoding="utf-8")
    card = {
        "corpus": {
            "documents": DOCUMENTS,
            "seed": SEED,
            "characters": len(text),
            "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
        },
        "machine": opts.machine,
        "dictionaries": {},
    }
    for site, command in COMMANDS.items():
        name = site.replace(".", "_")
        run_dir = work / name
        argv = command.format(text=path, out=run_dir).split()
        print(" ".join(argv), file=sys.stderr)
        code = cli(argv[3:])
        if code:
            return code
        report = json.loads((run_dir / "report.json").read_text(encoding="utf-8"))
        target = out / name
        target.mkdir(parents=True, exist_ok=True)
        for file in ("cfg.json", "sae_weights.safetensors", "report.json"):
            shutil.copyfile(run_dir / file, target / file)
        shown = command.format(text="{text}", out=f"assets/dictionaries/{name}")
        card["dictionaries"][name] = {"command": shown, "report": report}
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n", encoding="utf-8")
    (out / "README.md").write_text(render(card), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
