"""``python -m tracing run``: one prompt traced into a .safetensors trace file (and its tables), on
a model loaded here or on a model server (``--server``); ``--attribute --causal N`` adds the causal
check of the attribution.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..analyses.graph import Graph
from ..errors import InputError
from ..runner import TraceRequest
from ..sampling import SEEDS
from ..trace import Trace
from .inputs import add_intervention_flags, finite, integer, intervention_spec, named_path, regular_file, token_ids
from .loading import add_device_options, add_source_options, open_from_args, parse_device, parse_dtype, refuse_local_flags
from .output import REUSED
from .progress import ProgressBar, stream_bar
from .sets import add_set_options


def add_parser(sub) -> None:
    run = sub.add_parser("run", help="trace one prompt into a .safetensors trace file")
    add_source_options(run, "synthetic weights of this config (no download)", server=True)
    inp = run.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    inp.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    inp.add_argument(
        "--prompts",
        type=named_path,
        metavar="FILE",
        help="with --attribute --causal N: a set of prompts (one a line, or JSONL with prompt and optionally target, "
        "contrast), each checked, the means with bootstrap intervals in --csv (no trace file)",
    )
    run.add_argument(
        "--out",
        type=named_path,
        help="trace file to write (.safetensors); replaces a regular file, refuses anything else (required but with --prompts)",
    )
    run.add_argument("--csv", type=named_path, help=f"also write every table as CSV into this directory{REUSED}")
    run.add_argument("--parquet", action="store_true", help="with --csv: Parquet files too")
    add_device_options(run)
    run.add_argument(
        "--prefill",
        type=integer(),
        metavar="N",
        help="run the first N positions as one prefill and each later one alone through the decode path "
        "(absorbed attention over the cached latents, as a generation does); default: one prefill of all",
    )
    run.add_argument(
        "--generate",
        type=integer(),
        default=0,
        metavar="N",
        help="after the prompt, generate N tokens through the decode path (stops after the end-of-sequence token)",
    )
    run.add_argument("--temperature", type=finite, help="with --generate: 0 (default) is greedy; above 0 samples")
    run.add_argument("--top-p", type=finite, help="with --generate and a temperature: nucleus sampling (0, 1], default 1")
    run.add_argument(
        "--seed", type=integer(*SEEDS), help="with --generate and a temperature: the sampling seed (default: drawn, recorded)"
    )
    run.add_argument("--chat", action="store_true", help="wrap --prompt as a user turn of DeepSeek-V3.2's chat format")
    run.add_argument("--thinking", action="store_true", help="with --chat: the assistant turn starts in thinking mode")
    run.add_argument("--record", default="default", help="sites to record: glob patterns, comma-separated; 'default', 'all'")
    run.add_argument("--patch", type=named_path, help="safetensors file of site values that replace the model's (interventions)")
    run.add_argument(
        "--patch-from", type=named_path, metavar="TRACE", help="patch the --sites of this trace file (another prompt's run) in"
    )
    run.add_argument("--sites", metavar="PATTERN,...", help="with --patch-from: the sites to patch (glob patterns)")
    run.add_argument("--positions", metavar="P|A:B", help="with --patch or --patch-from: patch only these positions (A..B-1)")
    add_intervention_flags(run)
    run.add_argument(
        "--dictionary",
        action="append",
        metavar="DIR",
        help="a sparse dictionary (SAELens layout: cfg.json, sae_weights.safetensors) whose features at the site it "
        "reads are recorded (<site>.features.*, table features); repeatable, one per site; with --server, the name of "
        "one of the server's (serve --dictionaries)",
    )
    run.add_argument(
        "--feature",
        metavar="SITE:F=0|SITE:F*S|SITE:F+A[@P|@A:B],...",
        help="edit a feature of a --dictionary at its site: zero it, scale its activation by S, or add A times its "
        "decoder direction, at every position or at P / A..B-1 (e.g. layers.1.resid_post:17=0@5)",
    )
    run.add_argument(
        "--graph",
        type=named_path,
        metavar="FILE.json",
        help="an intervention graph (docs/graphs.md): reads, arithmetic, writes and saves at trace sites, every pass",
    )
    run.add_argument(
        "--attribute",
        action="store_true",
        help="direct logit attribution: the target logit split over the embedding, heads, experts and MLPs",
    )
    run.add_argument("--position", type=integer(), help="with --attribute: the position (default: the last)")
    run.add_argument("--target", metavar="TOKEN|ID", help="with --attribute: the token (default: the top prediction there)")
    run.add_argument("--contrast", metavar="TOKEN|ID", help="with --attribute: attribute target minus this token's logit")
    run.add_argument(
        "--causal",
        type=integer(1),
        metavar="N",
        help="with --attribute: remove each of the N largest parts at the position, measure the logit change (table causal)",
    )
    add_set_options(run)
    run.set_defaults(func=cmd_run)


def _load_patches(path: str) -> dict:
    from safetensors import SafetensorError, safe_open

    path = str(regular_file(path, "patch file", mapped=True))
    try:
        with safe_open(path, framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise InputError(f"{path}: not a readable patch file ({exc})") from None


def _patches_from(path: str | None, patterns: str | None) -> dict | None:
    """The values of ``path``'s trace at the sites ``patterns`` name (--patch-from TRACE --sites)."""
    from ..sites import select
    from ..trace import Trace

    if not path:
        return None
    if not patterns:
        raise InputError("--patch-from needs --sites: the sites to take from the trace, e.g. 'layers.1.resid_post'")
    trace = Trace.load(path)
    names = [n for n in select(trace.config, patterns) if n in trace.tensors]
    if not names:
        raise InputError(f"--patch-from {path}: the trace holds none of the sites {patterns!r}")
    return {name: trace.tensors[name] for name in names}


def request_from_args(args: argparse.Namespace) -> TraceRequest:
    """The TraceRequest ``run``'s flags ask for, checked (before any model loads)."""
    if args.causal is not None and not args.attribute:
        raise InputError("--causal applies to --attribute: the check removes the attribution's parts")
    if args.patch and args.patch_from:
        raise InputError("--patch and --patch-from exclude each other")
    if args.sites and not args.patch_from:
        raise InputError("--sites applies to --patch-from")
    interventions = intervention_spec(args)
    if args.feature:
        interventions["features"] = args.feature
    request = TraceRequest(
        dictionaries=tuple(args.dictionary or ()),
        prompt=args.prompt,
        token_ids=None if args.token_ids is None else token_ids(args.token_ids),
        chat=args.chat,
        thinking=args.thinking,
        record=args.record,
        prefill=args.prefill,
        generate=args.generate,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        attribute=args.attribute,
        position=args.position,
        target=args.target,
        contrast=args.contrast,
        interventions=interventions,
        patch_positions=args.positions,
        graph=Graph.load(args.graph) if args.graph else None,
        patches=_load_patches(args.patch)
        if args.patch
        else _patches_from(args.patch_from, args.sites)
        if args.patch_from
        else None,
    )
    return request.check()


def cmd_run(args: argparse.Namespace) -> int:
    from ..runner import run
    from ..tables import stage_tables, tables
    from .output import Outputs, check_directory, check_file

    if args.prompts is not None:
        return _over_prompts(args)
    if args.out is None:
        raise InputError("give --out TRACE.safetensors: the trace file to write")
    check_file(args.out)  # before the run, which may take long; checked again when writing
    request = request_from_args(args)
    if args.csv is not None:  # "" too: it names no directory, and must not mean "no tables"
        check_directory(args.csv)
    if args.server is not None:
        return _run_on_server(args, request)
    if args.token_file is not None:
        raise InputError("--token-file applies to --server")
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    rank0 = int(os.environ.get("RANK", "0")) == 0  # under torchrun only rank 0 reports and writes
    draw = rank0 and sys.stderr.isatty()  # a progress bar redrawn in place is for a terminal, not a log
    if args.synthetic and args.prompt is not None:
        raise InputError("synthetic weights have no tokenizer: pass --token-ids instead of --prompt")
    loaded = open_from_args(args, device, dtype, stream_bar() if draw else None)
    if args.prompt is not None and loaded.tokenizer is None:
        raise InputError(f"{loaded.label} has no tokenizer.json: pass --token-ids")
    progress = ProgressBar(len(loaded.model.layers), enabled=draw and not loaded.stream)  # streaming draws its own
    trace = run(
        loaded.model,
        request,
        loaded.tokenizer,
        on_block=lambda i: progress.update(i + 1, f"layers.{i}"),
        extra={"checkpoint": loaded.label},
        device=loaded.device,
        context=loaded.context(),
        plan=loaded.plan,
    )
    progress.close()
    if rank0 and (bad := trace.extra.get("nonfinite")):
        at = "" if bad["position"] is None else f" at position {bad['position']}"
        print(f"warning: non-finite values from {bad['site']}{at} on (recorded in the trace's metadata)", file=sys.stderr)
    frames = tables(trace) if rank0 and args.csv else {}
    if args.causal is not None:

        def again(changed: TraceRequest) -> Trace:
            return run(loaded.model, changed, loaded.tokenizer, device=loaded.device, context=loaded.context(), plan=loaded.plan)

        frames["causal"] = _causal(again, request, trace, args.causal, rank0)
    if rank0:
        with Outputs() as out:  # the trace and its tables land together or not at all
            out.file(args.out, trace.to_bytes())
            if args.csv:
                stage_tables(out, frames, args.csv, parquet=args.parquet)
        print(said(trace, args), file=sys.stderr)
    return 0


def _over_prompts(args: argparse.Namespace) -> int:
    """``run --attribute --causal N --prompts FILE``: the flags' request made for each line."""
    from .sets import cmd_causal_prompts

    if args.causal is None:
        raise InputError("--prompts applies to --attribute --causal N: the causal check over a set of prompts")
    template = request_from_args(argparse.Namespace(**{**vars(args), "prompt": "-"}))
    return cmd_causal_prompts(args, template)


def said(trace: Trace, args: argparse.Namespace) -> str:
    """``run``'s one line: what ran, what the model said (the top next token, or the text it wrote),
    where the files went."""
    from ..tables.frames import next_token_table

    line = f"traced {trace.n_tokens} tokens"
    if generation := trace.extra.get("generation"):
        start = generation["start"]
        line += f"; wrote {generation['generated']} ({generation['stopped']}): {''.join(trace.tokens[start:])!r}"
        if (mtp := generation.get("mtp_acceptance")) and mtp["drafts"]:
            line += f"; MTP drafts accepted {mtp['accepted']}/{mtp['drafts']} ({mtp['rate']:.0%})"
    elif not (top := next_token_table(trace, 1)).empty:
        line += f"; next token {top['token'].iloc[0]!r} (p={top['probability'].iloc[0]:.3f})"
    if streamed := trace.extra.get("stream"):
        from ..plan import weights_said

        line += "; " + weights_said(streamed)
    return line + f"; {args.out}" + (f", tables in {args.csv}" if args.csv else "")


def _causal(again, request: TraceRequest, trace: Trace, n: int, report: bool):
    """``run --attribute --causal N``: the N largest parts removed at the attributed position, each
    measured by ``again`` (a run of the changed request: here, or on the server) as
    tracing.analyses.causal does it; one line on stderr gives the correlation."""
    from ..analyses.causal import causal_check

    table = causal_check(again, request, n, trace)
    if report:
        r = table.attrs["correlation"]
        print(
            f"causal check: {len(table)} parts removed at position {trace.extra['attribution']['position']}; "
            f"correlation of attributed and measured {r:+.3f}",
            file=sys.stderr,
        )
    return table


def _run_on_server(args: argparse.Namespace, request: TraceRequest) -> int:
    """``run --server``: the server runs the request; the same outputs are written here."""
    from ..client import Client, read_token_file
    from ..tables import stage_tables, tables
    from .output import Outputs

    refuse_local_flags(args)
    draw = sys.stderr.isatty()
    progress = ProgressBar(1, enabled=draw)

    def show(event: dict) -> None:
        if "queued" in event and draw:
            sys.stderr.write(f"\rwaiting for the server: place {event['queued']} in its queue")
        elif "progress" in event:
            p = event["progress"]
            step = f" step {p['step']}/{p['steps']}" if p["steps"] else ""
            progress.total = p["blocks"]
            progress.update(p["block"], f"block{step}")

    with Client(args.server, read_token_file(args.token_file)) as client:
        data = client.trace_bytes(request, show)
        progress.close()
        trace = Trace.from_bytes(data, args.server)
        if bad := trace.extra.get("nonfinite"):
            at = "" if bad["position"] is None else f" at position {bad['position']}"
            print(f"warning: non-finite values from {bad['site']}{at} on (recorded in the trace's metadata)", file=sys.stderr)
        frames = tables(trace) if args.csv else {}
        if args.causal is not None:  # each removal one more request to the same server
            frames["causal"] = _causal(client.trace, request, trace, args.causal, True)
    with Outputs() as out:  # the server's bytes as they came: the file run writes in one process
        out.file(args.out, data)
        if args.csv:
            stage_tables(out, frames, args.csv, parquet=args.parquet)
    print(said(trace, args), file=sys.stderr)
    return 0
