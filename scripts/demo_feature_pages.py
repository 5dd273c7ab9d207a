"""Build the feature pages of the demo's bundled dictionaries (assets/dictionaries/pages), which the
app's Features page opens without a corpus run:

    python scripts/demo_feature_pages.py [--max-tokens 4096]

The same as ``python -m tracing dictionary features --checkpoint demo --dictionary
assets/dictionaries/<each> --text-file assets/demo/heldout_sample.txt --out assets/dictionaries/pages``
(the held-out sample: text the dictionaries were not trained on), with fewer contexts and tokens
per feature, and the Parquet tables only (0.7 MB where the CSV are 3.5 MB).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DICTIONARIES = REPO / "assets" / "dictionaries"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=4096, help="positions of the held-out sample read (default 4096)")
    args = parser.parse_args()
    found = sorted(p for p in DICTIONARIES.iterdir() if (p / "cfg.json").is_file()) if DICTIONARIES.is_dir() else []
    if not found:
        print(f"error: no dictionary in {DICTIONARIES} (scripts/demo_dictionaries.py builds them)", file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "tracing", "dictionary", "features", "--checkpoint", "demo"]
    for directory in found:
        command += ["--dictionary", str(directory)]
    command += ["--text-file", str(REPO / "assets" / "demo" / "heldout_sample.txt"), "--max-tokens", str(args.max_tokens)]
    command += ["--contexts", "5", "--window", "6", "--logit-tokens", "5", "--parquet", "--out", str(DICTIONARIES / "pages")]
    code = subprocess.call(command, cwd=REPO)
    for csv in (DICTIONARIES / "pages").glob("*.csv"):  # the Parquet tables alone: a fifth of the bytes
        csv.unlink()
    return code


if __name__ == "__main__":
    sys.exit(main())
