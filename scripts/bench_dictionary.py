"""Dictionary training: quality and time on the demo, and the activation buffer's cost at a wider model.

    python scripts/bench_dictionary.py --text-file /tmp/demo-dictionaries/dictionary_corpus.txt
    python scripts/bench_dictionary.py --sizes 256:8,1024:16,4096:32 --max-tokens 40000 --epochs 8

A benchmark run by hand, not a test; it prints one JSON object on stdout (progress on stderr).

Cases:

* ``demo``: per size (features:k), ``tracing.dictionary.train`` of a TopK autoencoder on the demo's
  ``layers.1.resid_post`` over ``--text-file`` (default: the text scripts/demo_dictionaries.py
  trains the bundled dictionaries on, built from ``--corpus``), at most ``--max-tokens`` positions,
  ``--epochs`` passes: the held-out report (variance explained, L0, dead share, next-token loss clean
  and spliced) and the wall time of the whole run (gathering, steps, evaluation).
* ``mid``: the mid-size synthetic config (model.config.MID: hidden 1024, 8 blocks) with random
  token ids, sequences of 512, batches of 2: ``--mid-batches`` batches of ``layers.3.resid_post``
  rows gathered into an ActivationBuffer bounded at ``--mid-buffer-mb`` and read back once. Reported:
  rows, bytes on disk, the most bytes of rows the buffer held in memory at once, and the process's
  resident memory before and (at most) while reading the buffer back. Then the real model's width:
  random rows of 7168 filling ``--real-buffer-mb`` on disk, written and read back the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from tracing.startup import load_torch  # noqa: E402

load_torch()

# isort: split
import torch  # noqa: E402

from model.checkpoint import load_model  # noqa: E402
from model.config import MID  # noqa: E402
from model.synthetic import SyntheticSource  # noqa: E402
from tracing.cli.loading import Loaded, open_checkpoint  # noqa: E402
from tracing.dictionary.buffer import ActivationBuffer  # noqa: E402
from tracing.dictionary.sources import LocalModel  # noqa: E402
from tracing.dictionary.train import train  # noqa: E402

REAL_DIM = 7168
SITE = "layers.1.resid_post"


def log(msg: str) -> None:
    print(f"[bench_dictionary {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def demo_case(text: Path, sizes: list[tuple[int, int]], max_tokens: int, epochs: int) -> list[dict]:
    loaded = open_checkpoint("demo")
    rows = []
    for features, k in sizes:
        with tempfile.TemporaryDirectory() as out:
            log(f"demo: {features} features, k {k}")
            started = time.perf_counter()
            report = train(
                loaded, [text], Path(out) / "d", site=SITE, features=features, k=k, max_tokens=max_tokens, epochs=epochs,
                rows_per_step=512, dead_tokens=20_000,
            )  # fmt: skip
            wall = time.perf_counter() - started
        keep = ("variance_explained", "l0", "dead_share", "clean_loss", "spliced_loss", "loss_increase", "steps", "train_rows")
        rows.append({"features": features, "k": k, **{key: report[key] for key in keep}, "seconds": round(wall, 1)})
        log(json.dumps(rows[-1]))
    return rows


def rss_mb() -> float:
    """The process's resident memory now (/proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read_back(buffer: ActivationBuffer, gen: torch.Generator) -> tuple[int, float]:
    """Every row once in batches of 1024; the rows read and the most resident memory seen meanwhile."""
    rows, most = 0, rss_mb()
    for batch in buffer.batches(1024, gen):
        rows += len(batch[0])
        most = max(most, rss_mb())
    return rows, most


def mid_case(n_batches: int, buffer_mb: float, real_mb: float) -> dict:
    args = MID
    model = load_model(SyntheticSource(args, seed=0))
    loaded = Loaded(model, None, None, "synthetic:MID", torch.device("cpu"))
    source = LocalModel(loaded, "sae", "layers.3.resid_post", 3, skip_first=False)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"config": "model.config.MID", "dim": args.dim, "site": "layers.3.resid_post"}
    with tempfile.TemporaryDirectory() as tmp:
        buffer = ActivationBuffer(Path(tmp) / "buffer", args.dim, None, int(buffer_mb * 2**20))
        started = time.perf_counter()
        for b in range(n_batches):
            ids = torch.randint(0, args.vocab_size, (2, 512), generator=gen).tolist()
            buffer.add(*source.rows(ids))
            log(f"mid: batch {b + 1}/{n_batches}, {buffer.rows} rows")
        gathered = time.perf_counter() - started
        buffer.flush()
        before = rss_mb()
        rows, most = read_back(buffer, gen)
        out.update(
            rows=rows,
            row_bytes=buffer.row_bytes,
            bytes_on_disk=buffer.bytes_on_disk,
            chunk_rows=buffer.chunk_rows,
            buffer_bound_bytes=buffer.max_bytes,
            buffer_peak_memory_bytes=buffer.peak_bytes,
            rss_mb_before_reading=round(before, 1),
            rss_mb_most_while_reading=round(most, 1),
            gather_seconds=round(gathered, 1),
        )
    del model, loaded, source
    # the real width: random rows of 7168, as many as fill --real-buffer-mb, written and read back
    with tempfile.TemporaryDirectory() as tmp:
        buffer = ActivationBuffer(Path(tmp) / "buffer", REAL_DIM, None, int(real_mb * 2**20))
        before = rss_mb()
        started = time.perf_counter()
        while not buffer.full:
            buffer.add(torch.randn(512, REAL_DIM, generator=gen))
        buffer.flush()
        written = time.perf_counter() - started
        rows, most = read_back(buffer, gen)
        out["real_width"] = {
            "dim": REAL_DIM,
            "rows": rows,
            "row_bytes": buffer.row_bytes,
            "bytes_on_disk": buffer.bytes_on_disk,
            "chunk_rows": buffer.chunk_rows,
            "buffer_peak_memory_bytes": buffer.peak_bytes,
            "rss_mb_before": round(before, 1),
            "rss_mb_most_while_reading": round(most, 1),
            "write_seconds": round(written, 1),
            "read_seconds": round(time.perf_counter() - started - written, 1),
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--text-file", type=Path, help="the demo's training text (default: built from --corpus)")
    parser.add_argument("--corpus", default="/tmp/demo-corpus", help="scripts/demo_corpus.py's cache of the two packages")
    parser.add_argument("--sizes", default="256:8,1024:16", help="features:k, comma separated (default 256:8,1024:16)")
    parser.add_argument("--max-tokens", type=int, default=12_000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--mid-batches", type=int, default=4, help="batches of 2 x 512 positions (default 4)")
    parser.add_argument("--mid-buffer-mb", type=float, default=64.0)
    parser.add_argument("--real-buffer-mb", type=float, default=1024.0, help="random rows of width 7168 (default 1024)")
    parser.add_argument("--cases", default="demo,mid")
    opts = parser.parse_args()
    from bench_forward import cpu_name, load_average

    result: dict = {"machine": {"cpu": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__}}
    result["machine"]["load_average_start"] = load_average()
    cases = opts.cases.split(",")
    if "demo" in cases:
        text = opts.text_file
        if text is None:
            import demo_dictionaries

            text = Path(tempfile.mkdtemp()) / "dictionary_corpus.txt"
            text.write_text(demo_dictionaries.corpus_text(Path(opts.corpus)), encoding="utf-8")
        sizes = [tuple(int(v) for v in size.split(":")) for size in opts.sizes.split(",")]
        result["demo"] = {
            "text": str(text),
            "max_tokens": opts.max_tokens,
            "epochs": opts.epochs,
            "site": SITE,
            "sizes": demo_case(text, sizes, opts.max_tokens, opts.epochs),
        }
    if "mid" in cases:
        result["mid"] = mid_case(opts.mid_batches, opts.mid_buffer_mb, opts.real_buffer_mb)
    result["machine"]["load_average_end"] = load_average()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
