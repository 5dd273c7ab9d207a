"""Build the bundled demo atlas (assets/demo_atlas) from the demo's held-out texts.

    python scripts/demo_atlas.py [--corpus /tmp/demo-corpus] [--texts /tmp/demo-atlas-texts] [--out assets/demo_atlas]

The held-out texts are the demo's (scripts/demo_corpus.py fetches the two Debian packages into
``--corpus`` and splits them off before training): the last three chapters of *Persuasion* and the
whole Python FAQ. They are written to ``--texts`` as two UTF-8 files, then ``ATLAS_COMMAND`` runs
(``python -m tracing atlas`` with those files), and the atlas directory keeps its tables and
summary.json only: the checkpoint of the counts (atlas_state.safetensors) is not bundled.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

TEXTS = {"austen_heldout.txt": "heldout_austen", "python_faq_heldout.txt": "heldout_pydoc"}
ATLAS_COMMAND = (
    "python -m tracing atlas --checkpoint demo --text-file {texts}/austen_heldout.txt "
    "--text-file {texts}/python_faq_heldout.txt --out {out} --seq-len 256 --batch-size 8"
)


def main() -> int:
    import demo_corpus

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default="/tmp/demo-corpus", help="scripts/demo_corpus.py's cache of the two packages")
    parser.add_argument("--texts", default="/tmp/demo-atlas-texts", help="where the held-out texts are written")
    parser.add_argument("--out", default=str(REPO / "assets" / "demo_atlas"))
    opts = parser.parse_args()
    corpus = demo_corpus.build(demo_corpus.fetch(Path(opts.corpus)))
    texts = Path(opts.texts)
    texts.mkdir(parents=True, exist_ok=True)
    for name, attr in TEXTS.items():
        (texts / name).write_text(getattr(corpus, attr), encoding="utf-8")
    command = ATLAS_COMMAND.format(texts=texts, out=opts.out)
    print(command, file=sys.stderr)
    from tracing.cli.commands import main as cli

    code = cli(command.split()[3:])
    if code == 0:
        (Path(opts.out) / "atlas_state.safetensors").unlink()
    return code


if __name__ == "__main__":
    sys.exit(main())
