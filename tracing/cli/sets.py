"""Prompt sets on the command line (tracing.analyses.prompt_sets): ``patching --pairs FILE``,
``run --attribute --causal N --prompts FILE`` and ``eval --prompts FILE``, each mean with its seeded
bootstrap interval. The file is read and every line checked before any model loads."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterator

from ..analyses import bootstrap
from ..errors import InputError
from .inputs import integer, regular_file
from .progress import ProgressBar


def add_set_options(parser) -> None:
    """--bootstrap-seed and --resamples: the interval of every command that takes a prompt set."""
    parser.add_argument(
        "--bootstrap-seed",
        type=integer(0, 2**64 - 1),
        default=bootstrap.SEED,
        metavar="S",
        help=f"with a prompt set: the bootstrap's seed (default {bootstrap.SEED}: the same interval every run)",
    )
    parser.add_argument(
        "--resamples",
        type=integer(1, bootstrap.MAX_RESAMPLES),
        default=bootstrap.RESAMPLES,
        metavar="B",
        help=f"with a prompt set: bootstrap draws of the prompts (default {bootstrap.RESAMPLES:,})",
    )


def read_set(path: str, parse: Callable[[bytes, str], list]) -> list:
    """The items of a prompt file: a regular file of bounded size, every line checked (parse)."""
    from ..analyses.prompt_sets import MAX_BYTES

    found = regular_file(path, "file of prompts", limit=MAX_BYTES)
    try:
        data = found.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read the file of prompts ({exc.strerror or exc})") from None
    return parse(data, str(path))


@contextlib.contextmanager
def over_set(args: argparse.Namespace, what: str, count: int) -> Iterator[tuple[Callable, object, Callable[[int, int], None]]]:
    """The model to run a set's items on (loaded here or a server's: patching._runner) and the
    project's progress bar over them: yields (run, tokenizer, on_item(i, n) before item i). The bar
    ends at done when the work does; the bar and the model are closed either way."""
    from .patching import _runner

    unit = "pairs" if what == "patching" else "prompts"
    run, tokenizer, close = _runner(args, True)
    bar = ProgressBar(count, enabled=sys.stderr.isatty())
    print(f"{what}: {count} {unit}", file=sys.stderr)
    try:
        yield run, tokenizer, lambda i, n: bar.update(i, unit)
        bar.update(bar.total, "done")
    finally:
        bar.close()
        close()


def interval(row) -> str:
    """``+0.123 [+0.050, +0.201]``: a mean and its interval, as the lines on stderr print them."""
    return f"{row['mean']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]"


def cmd_pairs(args: argparse.Namespace) -> int:
    """``patching --pairs FILE``: every pair's sweep, the per-cell means (patching_mean), every
    pair's rows (patching_pairs) and summary.json in ``--out``."""
    from ..analyses.patching import parse_sites
    from ..analyses.prompt_sets import parse_pairs, patching_over_pairs
    from ..runner import token_id
    from ..tables import to_csv_bytes
    from .output import Outputs, check_directory
    from .patching import FILES, PAIR_FILES

    given = [f"--{flag}" for flag in ("clean", "clean_ids", "corrupt", "corrupt_ids") if getattr(args, flag) is not None]
    if given:
        raise InputError(f"--pairs and {given[0].replace('_', '-')} exclude each other: the pairs come from the file")
    if args.synthetic is not None:
        raise InputError("--pairs holds text, and synthetic weights have no tokenizer: give --checkpoint or --server")
    check_directory(args.out)
    parse_sites(args.sites)
    pairs = read_set(args.pairs, parse_pairs)
    with over_set(args, "patching", len(pairs)) as (run, tokenizer, on_pair):
        result = patching_over_pairs(
            run,
            pairs,
            n_tokens=lambda request: len(tokenizer.encode(request.prompt)),
            target=args.target,
            contrast=args.contrast,
            on_pair=on_pair,
            resamples=args.resamples,
            seed=args.bootstrap_seed,
            sites=args.sites,
            positions=args.positions,
            max_runs=args.max_runs,
            token_id=lambda flag, value: token_id(flag, value, tokenizer),
            method=args.method,
        )
    with Outputs() as out:  # the tables and the summary land together or not at all
        folder = out.directory(args.out, stale=FILES | PAIR_FILES)
        for name, frame in (("patching_mean", result.table), ("patching_pairs", result.each)):
            data = to_csv_bytes(frame)
            folder.write(f"{name}.csv", lambda path, data=data: path.write_bytes(data))
            if args.parquet:
                folder.write(f"{name}.parquet", lambda path, frame=frame: frame.to_parquet(path, index=False))
        summary = json.dumps(result.summary, indent=1, allow_nan=False).encode()
        folder.write("summary.json", lambda path: path.write_bytes(summary))
    s, table = result.summary, result.table
    best = table.loc[table["mean"].abs().idxmax()] if table["mean"].notna().any() else None
    said = f"; largest mean {best['site']} block {best['block']}: {interval(best)}" if best is not None else ""
    print(f"patching: {s['pairs']} pairs, {s['runs']} runs in {s['seconds']:.1f} s{said}; {args.out}", file=sys.stderr)
    return 0


def cmd_causal_prompts(args: argparse.Namespace, template) -> int:
    """``run --attribute --causal N --prompts FILE``: the causal check of every prompt; tables causal
    (every prompt's parts), causal_summary (the measures' means) and causal_parts in ``--csv``."""
    from ..analyses.prompt_sets import causal_over_prompts, parse_prompts
    from ..tables import stage_tables
    from .output import Outputs, check_directory

    if args.out is not None:
        raise InputError("--out names one trace: with --prompts the tables go to --csv DIR")
    if args.csv is None:
        raise InputError("--prompts needs --csv DIR: the tables causal, causal_summary and causal_parts go there")
    check_directory(args.csv)
    prompts = read_set(args.prompts, parse_prompts)
    with over_set(args, "causal check", len(prompts)) as (run, _, on_prompt):
        result = causal_over_prompts(
            run, prompts, template, args.causal, on_prompt, resamples=args.resamples, seed=args.bootstrap_seed
        )
    frames = {"causal": result.each, "causal_summary": result.table, "causal_parts": result.parts}
    with Outputs() as out:
        stage_tables(out, frames, args.csv, parquet=args.parquet)
    r = result.table.set_index("measure").loc["correlation"]
    print(
        f"causal check over {len(prompts)} prompts, {result.summary['removals']} removals: correlation of attributed "
        f"and measured {interval(r)} (mean over {int(r['n'])} prompts, {bootstrap.LEVEL:.0%} bootstrap interval); {args.csv}",
        file=sys.stderr,
    )
    return 0


def cmd_eval_prompts(args: argparse.Namespace, spec: dict, graph=None) -> int:
    """``eval --prompts FILE [interventions] [--graph G]``: the next-token loss of each prompt, plain
    and (with an intervention or a graph) changed, their paired difference; one JSON line, tables
    eval and eval_prompts in ``--csv``."""
    from ..analyses.prompt_sets import loss_over_prompts, parse_prompts
    from ..runner import TraceRequest
    from ..tables import stage_tables
    from .output import Outputs, check_directory

    if args.csv is not None:
        check_directory(args.csv)
    template = TraceRequest(prompt="-").check()
    changed = (lambda request: dataclasses.replace(request, interventions=spec, graph=graph)) if spec or graph else None
    if changed is not None:
        changed(template).check()  # a malformed intervention, before the model loads
    prompts = read_set(args.prompts, parse_prompts)
    with over_set(args, "eval", len(prompts)) as (run, _, on_prompt):
        result = loss_over_prompts(run, prompts, template, changed, on_prompt, args.resamples, args.bootstrap_seed)
    if args.csv is not None:
        with Outputs() as out:
            stage_tables(out, {"eval": result.table, "eval_prompts": result.each}, args.csv, parquet=args.parquet)
    line = dict(result.summary)
    for row in result.table.to_dict("records"):
        measure = row.pop("measure")
        line[measure] = {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
    if spec:
        line["interventions"] = spec
    if graph is not None:
        line["graph"] = graph.fingerprint()
    print(json.dumps(line, allow_nan=False))
    return 0
