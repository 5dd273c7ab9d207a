"""Streaming throughput against the raw read speed of the same shards, and peak host memory.

Writes a multi-GB synthetic checkpoint in the real layout (the 671B config cut to its first
blocks, optionally with fewer routed experts) with model.checkpoint.save_checkpoint. Then:

- once, a streamed prefill on the CPU (model.stream.stream_forward, read-ahead on): its wall
  time, the loader thread's read rate, and the process's peak RSS (VmHWM, reset before the run)
  against the largest block's weights (all its experts). On a CPU this is bound by the forward's
  FP8 dequantisation, not by the reads;
- in rounds, each time after evicting the shards from the page cache (posix_fadvise DONTNEED):
  a raw sequential read of the whole shard files (16 MiB reads into one buffer); the same
  schedule streamed without the forward (``Streamer.replay``: same reader, read-ahead thread,
  assignment and freeing, the experts the prefill picked), which is what streaming reads at when
  computing costs little next to reading (a GPU); a raw read of exactly those tensors in the
  same order (pread into one buffer).

Prints one JSON object. The virtual disk of a VM may be cached by its host, which DONTNEED
cannot evict: "cold" reads can then run faster than the device; the rounds show the spread.

    python scripts/bench_stream.py --n-layers 4 --experts 64 --tokens 8

``--tiers`` measures the weight tiers (model.tiers) instead: for device budgets of nothing, half
and all of the model (no host tier), and for a host tier of all of it (no device tier), two
identical streamed prefills, each after evicting the shards from the page cache: the bytes from
disk, from the host tier and kept on the device, and the seconds, of the first and the second.
On the bundled demo (``--checkpoint demo``) or a mid-size synthetic model written to ``--dir``
(the demo's config widened: ``--mid``):

    python scripts/bench_stream.py --tiers --checkpoint demo --tokens 32
    python scripts/bench_stream.py --tiers --mid --tokens 32
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from model.checkpoint import SafetensorsSource, TensorReader, build_model, save_checkpoint  # noqa: E402
from model.config import ModelArgs  # noqa: E402
from model.names import layer_of  # noqa: E402
from model.stream import Streamer, held_bytes, stream_forward  # noqa: E402
from model.synthetic import SyntheticSource, truncate_layers  # noqa: E402
from model.tiers import Tiers  # noqa: E402

CONFIG = REPO / "assets" / "configs" / "config_671B_hf.json"
CHUNK = 16 << 20


class _Lazy:
    """Stands for a tensor in save_checkpoint's mapping: sizes from the spec, drawn when written."""

    def __init__(self, source: SyntheticSource, name: str):
        self.source, self.name, self.spec = source, name, source.specs()[name]

    def numel(self) -> int:
        return math.prod(self.spec.shape)

    def element_size(self) -> int:
        return self.spec.dtype.itemsize

    def contiguous(self) -> torch.Tensor:
        return self.source.load(self.name)


def bench_args(config: Path, n_layers: int, experts: int) -> ModelArgs:
    args = truncate_layers(ModelArgs.from_file(config), n_layers)
    if experts != args.n_routed_experts:
        args = args.replace(n_routed_experts=experts)
    return args


def write_checkpoint(directory: Path, args: ModelArgs, shard_bytes: int) -> dict:
    source = SyntheticSource(args, seed=0)
    total = source.nbytes(source.specs())
    free = shutil.disk_usage(directory.parent).free
    if free < total * 1.2:
        raise SystemExit(f"{directory.parent}: {free / 1e9:.1f} GB free, {total * 1.2 / 1e9:.1f} GB needed")
    t = time.perf_counter()
    lazy = {name: _Lazy(source, name) for name in source.specs()}
    save_checkpoint(lazy, args, directory, n_shards=max(1, math.ceil(total / shard_bytes)))
    return {"bytes": total, "write_seconds": round(time.perf_counter() - t, 1)}


def evict(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_sequential(paths: list[Path]) -> tuple[int, float]:
    buf = memoryview(bytearray(CHUNK))
    total, t = 0, time.perf_counter()
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total, time.perf_counter() - t


def raw_same(source: SafetensorsSource, names: list[str]) -> tuple[int, float]:
    """pread of the byte ranges of ``names``, in that order, into one buffer."""
    reader = TensorReader(source)  # only to find the bytes; the reads below are plain preads
    places = [reader.locate(name) for name in names]
    buf = memoryview(bytearray(CHUNK))
    total, t = 0, time.perf_counter()
    for fd, pos, length in places:
        stop = pos + length
        while pos < stop:
            n = os.preadv(fd, [buf[: min(CHUNK, stop - pos)]], pos)
            pos += n
            total += n
    seconds = time.perf_counter() - t
    reader.close()
    return total, seconds


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def streamed(source: SafetensorsSource, tokens: torch.Tensor, expert_window: int) -> dict:
    """A streamed prefill: reads and the CPU forward, overlapped by the read-ahead thread."""
    model = build_model(source.args, torch.bfloat16)
    base = _status("VmRSS")
    reset = reset_peak_rss()
    t = time.perf_counter()
    _, stats = stream_forward(model, source, tokens, "cpu", expert_window=expert_window)
    wall = time.perf_counter() - t
    picked: dict[int, list[int]] = {}
    for name in stats.reads:
        if ".experts." in name and name.endswith("gate_proj.weight"):
            picked.setdefault(layer_of(name), []).append(int(name.split(".")[5]))
    return {
        "bytes": stats.bytes_read,
        "wall_seconds": wall,
        "load_seconds": stats.load_seconds,
        "wait_seconds": stats.wait_seconds,
        "compute_seconds": stats.compute_seconds,
        "peak_resident_weight_bytes": stats.peak_resident_bytes,
        "rss_before_bytes": base,
        "peak_rss_bytes": _status("VmHWM") if reset else None,
        "order": list(stats.reads),  # the order the loader read them in
        "picked": picked,
        "units": {name: u.bytes for name, u in stats.units.items()},
    }


def load_only(source: SafetensorsSource, picked: dict[int, list[int]], expert_window: int) -> dict:
    """The same schedule (same blocks, same picked experts) through the same streamer, no forward."""
    model = build_model(source.args, torch.bfloat16)
    reset = reset_peak_rss()
    t = time.perf_counter()
    with Streamer(model, source, "cpu", expert_window=expert_window) as streamer:
        streamer.replay(picked)
    wall = time.perf_counter() - t
    return {"bytes": streamer.stats.bytes_read, "wall_seconds": wall, "peak_rss_bytes": _status("VmHWM") if reset else None}


def measure(source: SafetensorsSource, opts: argparse.Namespace) -> dict:
    paths = sorted(source.directory / shard for shard in set(source.weight_map.values()))
    tokens = torch.randint(0, source.args.vocab_size, (1, opts.tokens), generator=torch.Generator().manual_seed(0))
    blocks: dict[int, int] = {}
    for name in source.specs():
        layer = layer_of(name)
        if layer is not None:
            blocks[layer] = blocks.get(layer, 0) + source.nbytes([name])
    largest = max(blocks.values())

    evict(paths)
    run = streamed(source, tokens, opts.expert_window)  # once: the CPU forward takes minutes
    rounds = []
    for _ in range(opts.rounds):
        evict(paths)
        seq_bytes, seq_s = raw_sequential(paths)
        evict(paths)
        replay = load_only(source, run["picked"], opts.expert_window)
        evict(paths)
        same_bytes, same_s = raw_same(source, run["order"])
        assert same_bytes == replay["bytes"] == run["bytes"], "the raw read must cover the same bytes"
        rounds.append(
            {
                "raw_sequential_gbps": round(seq_bytes / seq_s / 1e9, 3),
                "raw_same_tensors_gbps": round(same_bytes / same_s / 1e9, 3),
                "stream_load_only_gbps": round(replay["bytes"] / replay["wall_seconds"] / 1e9, 3),
                "stream_load_only_peak_rss_bytes": replay["peak_rss_bytes"],
            }
        )
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0] if rounds[0][k] is not None}
    end_to_end = run["bytes"] / run["wall_seconds"] / 1e9
    return {
        "checkpoint_bytes": sum(p.stat().st_size for p in paths),
        "shards": len(paths),
        "streamed_bytes": run["bytes"],
        "streamed_per_unit": run["units"],
        "largest_block_bytes": largest,
        "rounds": rounds,
        "median": med,
        "load_only_vs_raw_same": round(med["stream_load_only_gbps"] / med["raw_same_tensors_gbps"], 3),
        "load_only_vs_raw_sequential": round(med["stream_load_only_gbps"] / med["raw_sequential_gbps"], 3),
        "forward": {
            "wall_seconds": round(run["wall_seconds"], 1),
            "compute_seconds": round(run["compute_seconds"], 1),
            "wait_seconds": round(run["wait_seconds"], 1),
            "loader_gbps": round(run["bytes"] / run["load_seconds"] / 1e9, 3),
            "end_to_end_gbps": round(end_to_end, 3),
            "end_to_end_vs_raw_same": round(end_to_end / med["raw_same_tensors_gbps"], 3),
            "rss_before_bytes": run["rss_before_bytes"],
            "peak_rss_bytes": run["peak_rss_bytes"],
            "peak_resident_weight_bytes": run["peak_resident_weight_bytes"],
        },
        "peak_rss_over_largest_block": round(run["peak_rss_bytes"] / largest, 3) if run["peak_rss_bytes"] else None,
        "peak_resident_weights_over_largest_block": round(run["peak_resident_weight_bytes"] / largest, 3),
        "torch_threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
    }


DEMO = REPO / "assets" / "demo"
MID = {"dim": 1024, "inter_dim": 2816, "moe_inter_dim": 512, "n_layers": 6, "n_routed_experts": 64, "vocab_size": 16384}


def mid_args() -> ModelArgs:
    """A mid-size model: the demo's config (its FP8 layout, MLA, indexer) at width 1024 with 64
    experts of width 512 over 6 blocks: about 0.6 GB."""
    return ModelArgs.from_file(DEMO / "config.json").replace(**MID, n_mtp_layers=0)


def tiers(source: SafetensorsSource, tokens: torch.Tensor) -> dict:
    """Two identical prefills per budget: where each one's weights came from, and its seconds; every
    pass's logits must equal the first's (bit for bit, whatever the tiers held)."""
    paths = sorted(source.directory / shard for shard in set(source.weight_map.values()))
    model = build_model(source.args, torch.bfloat16)
    whole = held_bytes(model, "cuda")  # the weights as held (no CPU copies: streamed weights keep none)
    stored = source.nbytes([n for n in source.specs() if (layer_of(n) or 0) < source.args.n_layers])
    budgets = {"device none": (0, 0), "device half": (whole // 2, 0), "device all": (whole, 0), "host all": (0, stored)}
    out = {"weights_held_bytes": whole, "weights_stored_bytes": stored, "budgets": {}}
    first = None
    for label, (device, host) in budgets.items():
        kept = Tiers("cpu", device, host)
        rows = []
        for _ in range(2):
            evict(paths)
            t = time.perf_counter()
            logits, stats = stream_forward(model, source, tokens, "cpu", tiers=kept)
            first = logits if first is None else first
            if not torch.equal(logits, first):
                raise SystemExit(f"{label}: the logits differ from the first pass's")
            rows.append({**stats.accounting(), "seconds": round(time.perf_counter() - t, 3)})
        out["budgets"][label] = {
            "device_budget": device,
            "host_budget": host,
            "first": rows[0],
            "second": rows[1],
            "peak": {"device": kept.device_tier.peak, "host": kept.host_tier.peak},
        }
    out["logits_identical"] = True  # every pass's, checked above
    return out


def main_tiers(opts: argparse.Namespace) -> int:
    if opts.checkpoint == "demo" or opts.checkpoint is None and not opts.mid:
        directory, args, created = DEMO, None, False
    elif opts.checkpoint is not None:
        directory, args, created = Path(opts.checkpoint), None, False
    else:
        directory, args = opts.dir, mid_args()
        created = not directory.exists()
        if created:
            write_checkpoint(directory, args, int(opts.shard_gb * 1e9))
    try:
        source = SafetensorsSource(directory)
        if args is not None and source.args != args:
            raise SystemExit(f"{directory}: holds another config; remove it or pick another --dir")
        tokens = torch.randint(0, source.args.vocab_size, (1, opts.tokens), generator=torch.Generator().manual_seed(0))
        out = {"checkpoint": str(directory), "tokens": opts.tokens, **tiers(source, tokens)}
        out["torch_threads"], out["load_average"] = torch.get_num_threads(), os.getloadavg()
    finally:
        if created and not opts.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(json.dumps(out))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/bench_stream_ckpt"))
    parser.add_argument("--config", type=Path, default=CONFIG, help="default: the 671B config")
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--experts", type=int, default=64, help="routed experts per MoE block (real: 256)")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the read measurements")
    parser.add_argument("--expert-window", type=int, default=4)
    parser.add_argument("--shard-gb", type=float, default=2.0)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint it writes (reused by the next run)")
    parser.add_argument("--tiers", action="store_true", help="measure the weight tiers (see above) instead")
    parser.add_argument("--checkpoint", help="with --tiers: a checkpoint directory, or demo (the default)")
    parser.add_argument("--mid", action="store_true", help="with --tiers: the mid-size synthetic model, written to --dir")
    opts = parser.parse_args(argv)
    if opts.tiers:
        return main_tiers(opts)

    args = bench_args(opts.config, opts.n_layers, opts.experts)
    out: dict = {"config": {"n_layers": args.n_layers, "n_routed_experts": args.n_routed_experts, "tokens": opts.tokens}}
    created = not opts.dir.exists()  # only a checkpoint this script wrote is ever deleted
    try:
        if created:
            out["written"] = write_checkpoint(opts.dir, args, int(opts.shard_gb * 1e9))
        source = SafetensorsSource(opts.dir)
        if source.args != args:
            raise SystemExit(f"{opts.dir}: holds another config; remove it or pick another --dir")
        out.update(measure(source, opts))
    finally:
        if created and not opts.keep:
            shutil.rmtree(opts.dir, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
