"""python -m tracing {run, export, info, eval, diff, atlas}: the command line of docs/architecture.md (Contracts).

Bad input exits with status 2 and one line on stderr naming the problem, never a traceback, and
leaves no partial output file behind (outputs are written to a temporary name, then renamed); so
does an output that cannot be written (tracing.cli.output).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys

from model import fp8, kernels
from model.checkpoint import CheckpointError, SafetensorsSource, dtype_name, expected_specs
from model.config import ConfigError, ModelArgs
from model.params import count_params

from ..errors import InputError
from ..runner import TraceRequest
from ..sampling import SEEDS
from ..tokenizer import TokenizerError
from ..trace import Trace, TraceError
from . import atlas as atlas_cli
from . import patching as patching_cli
from . import plan as plan_cli
from . import serve
from .inputs import Parser, add_intervention_flags, finite, integer, intervention_spec, is_int, named_path, regular_file
from .loading import (
    add_device_options,
    add_source_options,
    open_checkpoint,
    open_from_args,
    parse_device,
    parse_dtype,
    refuse_server,
    resolve_checkpoint,
)
from .progress import ProgressBar, stream_bar

BAD_INPUT = (CheckpointError, ConfigError, InputError, TraceError, TokenizerError)
CONFIG_BYTES = 1 << 20  # a config.json is a few KB; more is not one


def token_ids(text: str, flag: str = "--token-ids") -> list[int]:
    """A flag's comma-separated token ids."""
    parts = [part for part in text.split(",") if part.strip()]
    if not all(is_int(part) for part in parts):
        raise InputError(f"{flag} {text!r}: expected comma-separated integers like 1,2,3")
    ids = [int(part) for part in parts]
    if not ids:
        raise InputError(f"{flag} is empty: nothing to trace")
    return ids


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
    request = TraceRequest(
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


def refuse_local_flags(args: argparse.Namespace) -> None:
    """With ``--server``: the flags that load a model here say nothing to the server's model."""
    given = (
        ("--stream", args.stream),
        ("--n-layers", args.n_layers is not None),
        ("--no-mtp", args.no_mtp),
        ("--inexact-fp8-sums", args.inexact_fp8_sums),
    )
    local = [flag for flag, on in given if on]
    if args.device != "cpu" or args.dtype != "bfloat16":
        local.append("--device/--dtype")
    if local:
        raise InputError(f"{', '.join(local)}: the server's model runs as it was started (python -m tracing serve ...)")


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


def cmd_diff(args: argparse.Namespace) -> int:
    from ..analyses.diff import diff_tables, summary
    from ..tables import write_tables
    from .output import check_directory

    if args.csv is not None:
        check_directory(args.csv)
    checkpoints = args.checkpoint is not None or args.against is not None
    if checkpoints:
        return _diff_checkpoints(args)
    if args.a is None or args.b is None:
        raise InputError(
            "diff compares two trace files (diff A B), or two checkpoints (--checkpoint A --against B --prompt TEXT)"
        )
    only = (("--prompt", args.prompt), ("--token-ids", args.token_ids), ("--record", args.record), ("--out-dir", args.out_dir))
    given = [flag for flag, value in only if value is not None]
    if given:
        raise InputError(f"{given[0]} applies to --checkpoint A --against B")
    a, b = Trace.load(args.a), Trace.load(args.b)
    tables = diff_tables(a, b)
    line = json.dumps(summary(a, b, tables), allow_nan=False)
    if args.csv:
        write_tables(tables, args.csv, parquet=args.parquet)
    print(line)
    return 0


DIFF_TRACES = frozenset({"a.safetensors", "b.safetensors", "summary.json"})  # what diff --out-dir holds


def _diff_checkpoints(args: argparse.Namespace) -> int:
    """``diff --checkpoint A --against B``: the prompt traced on each in turn (one model in memory),
    then the trace diff's tables (tracing.analyses.diff.trace_checkpoints)."""
    from ..analyses.diff import diff_tables, summary, trace_checkpoints
    from ..tables import stage_tables
    from .output import Outputs, check_directory

    if args.a is not None:
        raise InputError("diff compares two trace files or two checkpoints (--checkpoint A --against B), not both")
    if args.checkpoint is None or args.against is None:
        raise InputError("a checkpoint diff needs both --checkpoint A and --against B")
    if (args.prompt is None) == (args.token_ids is None):
        raise InputError("a checkpoint diff needs --prompt TEXT or --token-ids 1,2,3 (one of them)")
    if args.out_dir is not None:
        check_directory(args.out_dir)
    if args.parquet and not args.csv:
        raise InputError("--parquet applies to --csv")
    request = TraceRequest(
        prompt=args.prompt,
        token_ids=None if args.token_ids is None else token_ids(args.token_ids),
        record=args.record or "default",
    ).check()
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    draw = sys.stderr.isatty() and not args.stream  # streaming draws its own
    bars = [ProgressBar(1, enabled=draw), ProgressBar(1, enabled=draw)]

    def on_block(which: int, i: int, n: int) -> None:
        bars[which].total = n
        bars[which].update(i + 1, f"{'ab'[which]}: layers.{i}")

    try:
        a, b = trace_checkpoints(
            args.checkpoint,
            args.against,
            request,
            device=device,
            dtype=dtype,
            stream=True if args.stream else None,
            on_block=on_block,
        )
    finally:
        for bar in bars:
            bar.close()
    tables = diff_tables(a, b)
    info = {"a": a.extra.get("checkpoint"), "b": b.extra.get("checkpoint"), **summary(a, b, tables)}
    line = json.dumps(info, allow_nan=False)
    with Outputs() as out:  # the traces, the summary and the tables land together or not at all
        if args.out_dir is not None:
            folder = out.directory(args.out_dir, stale=DIFF_TRACES)
            for name, data in (("a.safetensors", a.to_bytes()), ("b.safetensors", b.to_bytes()), ("summary.json", line.encode())):
                folder.write(name, lambda path, data=data: path.write_bytes(data))
        if args.csv:
            stage_tables(out, tables, args.csv, parquet=args.parquet)
    print(line)
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from ..tables import export

    export(Trace.load(args.trace), args.csv, parquet=args.parquet)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    if args.checkpoint:
        config = SafetensorsSource(resolve_checkpoint(args.checkpoint)).args
    else:
        config = ModelArgs.from_file(regular_file(args.config, "config file", CONFIG_BYTES))
    out = count_params(config)
    out.update(
        n_layers=config.n_layers,
        n_dense_layers=config.n_dense_layers,
        n_moe_layers=config.n_moe_layers,
        dim=config.dim,
        vocab_size=config.vocab_size,
        n_routed_experts=config.n_routed_experts,
        n_activated_experts=config.n_activated_experts,
        index_topk=config.index_topk if config.has_indexer else None,  # None: no indexer (DeepSeek-V3 layout)
        dtype=config.dtype,
        config=config.to_reference(),
        **kernels.describe(),
    )
    if args.tensors:
        specs = expected_specs(config)
        out["tensors"] = {name: [list(s.shape), dtype_name(s.dtype)] for name, s in specs.items()}
    print(json.dumps(out, allow_nan=False))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..analyses.evaluate import evaluate

    path = regular_file(args.text_file, "text file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read the text file ({exc})") from None
    if not text.strip():
        raise InputError(f"{path}: the text file is empty")
    from ..analyses.intervention_specs import from_spec

    interventions = from_spec(intervention_spec(args))
    if any(getattr(i, "positions", None) is not None for i in interventions):
        raise InputError("eval: a removal acts at every position of every window (LAYER:ID@P applies to run)")
    loaded = open_checkpoint(args.checkpoint, parse_device(args.device), parse_dtype(args.dtype))
    if loaded.tokenizer is None:
        raise InputError(f"{loaded.label} has no tokenizer.json: eval needs one")
    print(json.dumps(evaluate(loaded.model, loaded.tokenizer, text, interventions=interventions), allow_nan=False))
    return 0


def _leave_process_group() -> None:
    """Under torchrun: wait for every rank (rank 0 may still be writing), then close the group, so
    no communication thread outlives the interpreter (that aborts the process)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


_REUSED = (
    " (a reused directory loses the table files of an earlier run, tokens.csv, router.parquet and the like, "
    "that this one does not write; other files stay)"
)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m tracing", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="trace one prompt into a .safetensors trace file")
    add_source_options(run, "synthetic weights of this config (no download)", server=True)
    inp = run.add_mutually_exclusive_group(required=True)
    inp.add_argument("--prompt", help="text, encoded with the checkpoint's tokenizer.json")
    inp.add_argument("--token-ids", help="comma-separated token ids, e.g. 1,2,3")
    run.add_argument(
        "--out",
        type=named_path,
        required=True,
        help="trace file to write (.safetensors); replaces a regular file, refuses anything else",
    )
    run.add_argument("--csv", type=named_path, help=f"also write every table as CSV into this directory{_REUSED}")
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
    run.set_defaults(func=cmd_run)

    dif = sub.add_parser(
        "diff",
        help="compare two traces of one prompt, or one prompt on two checkpoints that share a tokenizer: stream drift, "
        "changed experts and keys, attention, predictions",
    )
    dif.add_argument("a", nargs="?", type=named_path, help="first trace (the baseline)")
    dif.add_argument("b", nargs="?", type=named_path, help="second trace")
    dif.add_argument("--checkpoint", type=named_path, metavar="A", help="instead of traces: the first checkpoint, or 'demo'")
    dif.add_argument("--against", type=named_path, metavar="B", help="with --checkpoint: the checkpoint compared with it")
    dinp = dif.add_mutually_exclusive_group()
    dinp.add_argument("--prompt", help="with --checkpoint: the text traced on both")
    dinp.add_argument("--token-ids", help="with --checkpoint: comma-separated token ids traced on both")
    dif.add_argument("--record", help="with --checkpoint: sites to record (default 'default'; logits.all is added)")
    dif.add_argument(
        "--out-dir", type=named_path, metavar="DIR", help="with --checkpoint: write a.safetensors, b.safetensors, summary.json"
    )
    dif.add_argument("--csv", type=named_path, help=f"write the comparison tables as CSV into this directory{_REUSED}")
    dif.add_argument("--parquet", action="store_true", help="with --csv: Parquet files too")
    add_device_options(dif)
    refuse_server(
        dif,
        "a server holds one model, and diff compares two: trace the prompt on each with "
        "'run --server URL --out A.safetensors', then 'diff A.safetensors B.safetensors'",
    )
    dif.set_defaults(func=cmd_diff)

    exp = sub.add_parser("export", help="write a trace's tables as CSV (and Parquet)")
    exp.add_argument("trace", type=named_path, help="trace file")
    exp.add_argument("--csv", type=named_path, required=True, help=f"output directory{_REUSED}")
    exp.add_argument("--parquet", action="store_true", help="Parquet files too")
    exp.set_defaults(func=cmd_export)

    info = sub.add_parser("info", help="parameter counts (and expected tensors) as JSON, from the architecture alone")
    isrc = info.add_mutually_exclusive_group(required=True)
    isrc.add_argument("--checkpoint", type=named_path, help="checkpoint directory, or 'demo'")
    isrc.add_argument("--config", type=named_path, help="config.json (Hugging Face) or the reference's JSON")
    info.add_argument("--tensors", action="store_true", help="add every expected tensor name with [shape, dtype]")
    info.set_defaults(func=cmd_info)

    ev = sub.add_parser("eval", help="next-token NLL, perplexity, top-1 accuracy and bits per byte on a text file")
    ev.add_argument("--checkpoint", type=named_path, required=True, help="checkpoint directory, or 'demo'")
    ev.add_argument("--text-file", type=named_path, required=True, help="UTF-8 text to score")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--dtype", default="bfloat16")
    add_intervention_flags(ev, positions=False)
    refuse_server(
        ev,
        "eval tokenizes the whole text and scores batches of windows of it on a model loaded here, "
        "and a server traces one prompt of at most its --max-prompt-tokens at a time: give --checkpoint",
    )
    ev.set_defaults(func=cmd_eval)

    atlas_cli.add_parser(sub)
    patching_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    serve.add_parser(sub)
    return parser


class Terminated(BaseException):
    """SIGTERM, raised where the process is, so that what it was writing is removed as on Ctrl-C."""


def _on_term(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    try:
        previous = signal.signal(signal.SIGTERM, _on_term)
    except ValueError:  # not the main thread: the caller handles its signals
        previous = None
    try:
        args = build_parser().parse_args(argv)
        whole_k = fp8.inexact_sums() if getattr(args, "inexact_fp8_sums", False) else contextlib.nullcontext()
        with kernels.serial_passes(), whole_k:  # a CPU forward's passes on one thread, large products on all
            return args.func(args)
    except BAD_INPUT as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (| head): not an error of ours
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("error: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        _leave_process_group()
