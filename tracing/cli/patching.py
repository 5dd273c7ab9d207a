"""``python -m tracing patching``: activation patching between a clean and a corrupt prompt
(tracing.analyses.patching), the table ``patching`` and ``summary.json`` in a directory."""

from __future__ import annotations

import argparse
import json
import sys
from functools import cached_property

from ..errors import InputError
from .inputs import integer, named_path
from .loading import add_device_options, add_source_options
from .sets import add_set_options

FILES = frozenset({"patching.csv", "patching.parquet", "summary.json"})  # what a sweep's directory holds
PAIR_FILES = frozenset({"patching_mean.csv", "patching_mean.parquet", "patching_pairs.csv", "patching_pairs.parquet"})


def add_parser(sub) -> None:
    patching = sub.add_parser(
        "patching",
        help="activation patching: the corrupt prompt with one value of the clean one put back, per site, block, "
        "position (head, expert), scored by the logit difference (table patching, summary.json)",
    )
    add_source_options(patching, "synthetic weights of this config (give --clean-ids and --corrupt-ids)", server=True)
    for which in ("clean", "corrupt"):
        given = patching.add_mutually_exclusive_group()  # one of them, or --pairs
        given.add_argument(f"--{which}", metavar="TEXT", help=f"the {which} prompt")
        given.add_argument(f"--{which}-ids", metavar="1,2,3", help=f"the {which} prompt as token ids")
    patching.add_argument(
        "--pairs",
        type=named_path,
        metavar="FILE",
        help="a set of pairs (JSONL with clean, corrupt and optionally target, contrast; or CSV with those columns): "
        "each pair's sweep and per cell the mean with its bootstrap interval (tables patching_mean, patching_pairs)",
    )
    patching.add_argument("--target", metavar="TOKEN|ID", help="the logit difference's target (default: the clean top token)")
    patching.add_argument(
        "--contrast", metavar="TOKEN|ID", help="minus this token's logit (default: the corrupt run's top token)"
    )
    patching.add_argument(
        "--sites", default="resid_pre,attn_out,ffn_out,heads,experts", help="which to patch (default: all five)"
    )
    patching.add_argument("--positions", default="all", help="all (default), last, or A:B (positions A..B-1)")
    patching.add_argument("--max-runs", type=integer(1), default=5000, help="refuse a sweep of more patched runs (default 5000)")
    patching.add_argument(
        "--method",
        default="exact",
        help="exact (default: one patched run per cell) or gradient (attribution patching: every cell from one "
        "backward pass, FP8 roundings passed straight through, selections held fixed; docs/attribution.md)",
    )
    patching.add_argument(
        "--out", required=True, type=named_path, metavar="DIR", help="the directory: patching.csv, summary.json"
    )
    patching.add_argument("--parquet", action="store_true", help="also patching.parquet")
    add_set_options(patching)
    add_device_options(patching)
    patching.set_defaults(func=cmd_patching)


def cmd_patching(args: argparse.Namespace) -> int:
    from ..analyses.patching import parse_method, parse_sites, sweep
    from ..runner import TraceRequest, token_id
    from ..tables import to_csv_bytes
    from .inputs import token_ids
    from .output import Outputs, check_directory
    from .progress import ProgressBar

    if args.pairs is not None:
        from .sets import cmd_pairs

        return cmd_pairs(args)
    for which in ("clean", "corrupt"):
        if getattr(args, which) is None and getattr(args, f"{which}_ids") is None:
            raise InputError(f"give --{which} or --{which}-ids (or --pairs FILE)")
    check_directory(args.out)
    parse_sites(args.sites)
    parse_method(args.method)
    requests = [
        TraceRequest(prompt=text, token_ids=None if ids is None else token_ids(ids, f"--{which}-ids")).check()
        for which, text, ids in (("clean", args.clean, args.clean_ids), ("corrupt", args.corrupt, args.corrupt_ids))
    ]
    run, tokenizer, close = _runner(args, any(r.prompt is not None for r in requests))
    progress = ProgressBar(1, enabled=sys.stderr.isatty())

    def on_cell(i: int, n: int) -> None:
        if i == 0:
            print(f"patching: {n} runs, one forward each", file=sys.stderr)
        progress.total = n
        progress.update(i + 1, "cell")

    try:
        result = sweep(
            run,
            *requests,
            target=args.target,
            contrast=args.contrast,
            sites=args.sites,
            positions=args.positions,
            max_runs=args.max_runs,
            token_id=lambda flag, value: token_id(flag, value, tokenizer),
            on_cell=on_cell,
            method=args.method,
        )
    finally:
        progress.close()
        close()
    with Outputs() as out:  # the table and the summary land together or not at all
        folder = out.directory(args.out, stale=FILES | PAIR_FILES)
        data = to_csv_bytes(result.table)
        folder.write("patching.csv", lambda path: path.write_bytes(data))
        if args.parquet:
            folder.write("patching.parquet", lambda path: result.table.to_parquet(path, index=False))
        summary = json.dumps(result.summary, indent=1, allow_nan=False).encode()
        folder.write("summary.json", lambda path: path.write_bytes(summary))
    s = result.summary
    print(
        f"patching ({s['method']}): {s['cells']} cells, {s['runs']} runs in {s['seconds']:.1f} s; "
        f"logit difference clean {s['clean']['logit_diff']:+.3f}, corrupt {s['corrupt']['logit_diff']:+.3f}; {args.out}",
        file=sys.stderr,
    )
    return 0


def _runner(args, needs_tokenizer: bool):
    """(run a request, the tokenizer or None, close): on a model server or a model loaded here."""
    from ..runner import run

    if args.server is not None:
        from ..client import Client, read_token_file
        from .loading import refuse_local_flags

        refuse_local_flags(args)
        client = Client(args.server, read_token_file(args.token_file))
        return (lambda request: client.trace(request)), ServerTokens(client), client.close
    if args.token_file is not None:
        raise InputError("--token-file applies to --server")
    from .loading import open_from_args, parse_device, parse_dtype

    loaded = open_from_args(args, parse_device(args.device), parse_dtype(args.dtype))
    if needs_tokenizer and loaded.tokenizer is None:
        raise InputError(f"{loaded.label} has no tokenizer.json: give --clean-ids and --corrupt-ids")

    def local(request):
        return run(loaded.model, request, loaded.tokenizer, device=loaded.device, context=loaded.context(), plan=loaded.plan)

    return local, loaded.tokenizer, lambda: None


class ServerTokens:
    """A model server's tokenizer as tracing.runner.token_id reads one: a ``--target`` or
    ``--contrast`` given as text is encoded by the server (/encode), as the app's are."""

    def __init__(self, client):
        self.client = client

    @cached_property
    def bos_id(self) -> int | None:
        return self.client.info()["config"].get("bos_token_id")

    def token_id(self, text: str) -> None:
        return None  # no lookup by name: the server's encoding reads special tokens in the text

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        from ..runner import TraceRequest

        ids = self.client.encode(TraceRequest(prompt=text))
        return ids[1:] if not add_bos and ids and ids[0] == self.bos_id else ids
