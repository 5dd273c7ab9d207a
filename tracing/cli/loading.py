"""Opening a model for tracing: a checkpoint directory (or the bundled demo), or synthetic weights."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import torch

from model.checkpoint import SafetensorsSource, WeightSource, build_model, check_mtp_copies, load_model, wants_mtp
from model.config import ConfigError
from model.synthetic import synthetic_source
from model.transformer import Transformer

from ..errors import InputError
from ..tokenizer import Tokenizer
from .inputs import integer, named_path

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "assets" / "demo"
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}


def resolve_checkpoint(value: str | Path) -> Path:
    """``demo`` names the bundled checkpoint; anything else is a directory."""
    return DEMO if str(value) == "demo" else Path(value).expanduser()


def synthetic_with_tokenizer(args) -> tuple:
    """``--synthetic CONFIG [--n-layers N] --tokenizer DIR`` for a command that cuts texts into
    tokens: the config (ModelArgs) and the tokenizer's directory (synthetic weights have none)."""
    if args.tokenizer is None:
        raise InputError("synthetic weights have no tokenizer: pass --tokenizer DIR (a tokenizer.json's directory, or demo)")
    try:
        config = synthetic_source(args.synthetic, args.n_layers).args
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return config, resolve_checkpoint(args.tokenizer)


def corpus_checkpoint(name: str | Path, reads: str) -> tuple[Path, object, str]:
    """``--checkpoint DIR`` for a command that cuts texts with the checkpoint's tokenizer: the
    directory, its config alone (the weights load once the texts are checked) and the label its
    results name it by. ``reads``: who reads the text, for the refusal."""
    directory = resolve_checkpoint(name)
    config = SafetensorsSource(directory).args
    if not (directory / "tokenizer.json").is_file():
        raise InputError(f"{directory} has no tokenizer.json: {reads} reads text")
    return directory, config, "demo" if directory == DEMO else str(directory.resolve())


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InputError(f"--dtype {name!r}: choose bfloat16 or float32") from None


def parse_budget(flag: str, text: str) -> int | None:
    """``--device-budget``/``--host-budget``: ``auto`` (None), ``0``, or an amount like 40GiB or 512MiB."""
    from ..plan import parse_memory

    text = str(text).strip()
    if text.lower() == "auto":
        return None
    if text in ("0", "0B"):
        return 0
    try:
        return parse_memory(text)
    except ValueError:
        raise InputError(f"{flag} {text!r}: give auto, 0 or an amount of memory like 40GiB or 512MiB") from None


def add_device_options(parser) -> None:
    """--device, --dtype, --stream and the tiers' budgets, as every command that runs a model takes them."""
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", default="bfloat16", help="bfloat16 (default, as the reference) or float32")
    parser.add_argument(
        "--no-mtp",
        action="store_true",
        help="leave the checkpoint's multi-token-prediction module unloaded (one MoE block less memory; no mtp.* sites)",
    )
    parser.add_argument(
        "--stream", action="store_true", help="load one block at a time (automatic when the model does not fit in memory)"
    )
    parser.add_argument(
        "--device-budget",
        default="auto",
        metavar="SIZE",
        help="streamed: the device memory kept for weights across passes (every non-expert weight first, then the"
        " experts used last), e.g. 40GiB or 0 (default auto: the free memory less what a request needs)",
    )
    parser.add_argument(
        "--host-budget",
        default="auto",
        metavar="SIZE",
        help="streamed: host memory (pinned on a GPU) kept for the weights the device does not keep, e.g. 600GiB or 0"
        " (default auto: the available memory less a reserve)",
    )
    parser.add_argument(
        "--inexact-fp8-sums",
        action="store_true",
        help="FP8 products summed over the whole K at once, not per 128-wide block as the reference's kernel: faster on"
        " the CPU, but outputs move by a bfloat16 unit here and there and selections downstream can change (said in"
        " the trace's metadata)",
    )


def add_source_options(parser, synthetic_help: str, server: bool = False) -> None:
    """--checkpoint DIR | --synthetic CONFIG [--n-layers N] (| --server URL [--token-file F]): the model a command runs."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=named_path, help="checkpoint directory (Hugging Face layout), or 'demo'")
    src.add_argument("--synthetic", type=named_path, metavar="CONFIG", help=synthetic_help)
    parser.add_argument("--n-layers", type=integer(), help="with --synthetic: keep the first N blocks")
    if server:
        src.add_argument("--server", metavar="URL", help="a model server (python -m tracing serve) runs it instead")
        parser.add_argument("--token-file", type=named_path, help="with --server: the file holding its bearer token")


def refuse_server(parser, why: str) -> None:
    """``--server`` on a command that cannot run on a model server: refused when given, with one
    line saying why (status 2), rather than argparse's unknown-argument message."""
    parser.add_argument("--server", action=_NoServer, why=why, metavar="URL", help=argparse.SUPPRESS)


def refuse_local_flags(args: argparse.Namespace) -> None:
    """With ``--server``: the flags that load a model here say nothing to the server's model."""
    given = (
        ("--stream", args.stream),
        ("--n-layers", args.n_layers is not None),
        ("--no-mtp", args.no_mtp),
        ("--inexact-fp8-sums", args.inexact_fp8_sums),
        ("--device-budget", str(getattr(args, "device_budget", "auto")).lower() != "auto"),
        ("--host-budget", str(getattr(args, "host_budget", "auto")).lower() != "auto"),
    )
    local = [flag for flag, on in given if on]
    if args.device != "cpu" or args.dtype != "bfloat16":
        local.append("--device/--dtype")
    if local:
        raise InputError(f"{', '.join(local)}: the server's model runs as it was started (python -m tracing serve ...)")


class _NoServer(argparse.Action):
    def __init__(self, *args, why: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.why = why

    def __call__(self, parser, namespace, values, option_string=None):
        raise InputError(f"{parser.prog} --server: {self.why}")


def open_from_args(args, device, dtype, progress=None, split: bool = True, group=None, tokens: int | None = None) -> Loaded:
    """The model that :func:`add_source_options` and :func:`add_device_options` named (``tokens``:
    the positions a request may hold, for the decision to stream)."""
    stream = True if args.stream else None  # None: stream when the model does not fit in memory
    budgets = budgets_from_args(args)
    if args.synthetic:
        return open_synthetic(
            args.synthetic, args.n_layers, device, dtype, stream, progress, split, group, tokens=tokens, budgets=budgets
        )
    if args.n_layers is not None:
        raise InputError("--n-layers applies to --synthetic only")
    mtp = False if getattr(args, "no_mtp", False) else None
    return open_checkpoint(
        args.checkpoint, device, dtype, stream, progress, split, group, mtp=mtp, tokens=tokens, budgets=budgets
    )


def budgets_from_args(args) -> tuple[int | None, int | None]:
    """(device, host) budgets of the tiers a stream keeps (model.tiers); None: automatic."""
    return (
        parse_budget("--device-budget", getattr(args, "device_budget", "auto")),
        parse_budget("--host-budget", getattr(args, "host_budget", "auto")),
    )


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"--device {name!r} is not a device (cpu or cuda)") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"--device {name!r}: the model runs on cpu or cuda, not {device.type}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available here")
    return device


@dataclass
class Loaded:
    """A model ready to trace, its tokenizer (None for synthetic weights) and where it came from.

    With ``stream`` the model stays on the meta device and ``context()`` streams its weights
    from ``source`` while it runs; with ``plan`` it is this rank's part of a model split over
    ranks (torchrun)."""

    model: Transformer
    tokenizer: Tokenizer | None
    source: WeightSource
    label: str
    device: torch.device
    stream: bool = False
    plan: object = None
    progress: object = None
    load: object = None  # tracing.plan.Load: held or streamed, and why (None where not decided)
    tiers: object = None  # model.tiers.Tiers: what streamed passes keep between them (with ``stream``)

    def context(self):
        if not self.stream:
            return None
        from model.stream import Streamer

        return Streamer(self.model, self.source, self.device, plan=self.plan, progress=self.progress, tiers=self.tiers)

    def run(self, prompts: str | list[str], hooks=None, **request):
        """Trace a prompt (a Trace) or several (a list of Traces, one run each, in order):
        ``request`` holds TraceRequest's fields (``record="all"``, ``generate=8``, ``interventions=``),
        ``hooks`` your functions at hook points (tracing.runner.run). The notebook's one call."""
        from ..runner import TraceRequest, run

        many = not isinstance(prompts, str)
        traces = [
            run(
                self.model,
                TraceRequest(prompt=prompt, **request),
                self.tokenizer,
                device=self.device,
                context=self.context(),
                plan=self.plan,
                hooks=hooks,
                extra={"checkpoint": self.label},
            )
            for prompt in ([prompts] if not many else prompts)
        ]
        return traces if many else traces[0]


def open_source(
    source: WeightSource,
    label: str,
    tokenizer: Tokenizer | None,
    device,
    dtype,
    stream: bool | None = None,
    progress=None,
    split: bool = True,
    group=None,
    mtp: bool | None = None,
    tokens: int | None = None,
    budgets: tuple[int | None, int | None] = (None, None),
) -> Loaded:
    """Load ``source`` for tracing: whole, or streamed (``stream``; None decides per rank, by
    tracing.plan.decide_load: this rank's part and a request of ``tokens`` positions against its
    device's free memory, every rank of a torchrun launch agreeing), over the ranks of a torchrun
    launch when there is one (``split``: tensor and expert parallel over ``group``, default every
    rank; without it every rank holds the whole model, for data parallel work). ``mtp``: the
    checkpoint's MTP module (None: loaded when it has one; streamed like a block, split over the
    ranks like a block). The decision is ``Loaded.load``. Streamed, ``Loaded.tiers`` keeps weights
    across passes within ``budgets`` (device, host; None: tracing.plan.tier_budgets decides)."""
    from model import parallel
    from model.tiers import Tiers

    from ..plan import DEFAULT_TOKENS, decide_load, tier_budgets

    device = torch.device(device)
    dist = parallel.init_distributed(device)
    if dist is not None:
        device = dist.device
    rank, world = parallel.rank_world(group) if dist is not None and split else (0, 1)
    load = None
    if stream is not False:  # None decides, True is said as forced
        load = decide_load(
            source, device, dtype, mtp, rank, world, dist is not None, tokens or DEFAULT_TOKENS, True if stream else None
        )
        stream = load.stream
    if stream:
        model = build_model(source.args, dtype, mtp=wants_mtp(source, mtp))
        plan = parallel.parallelize(model, group) if dist is not None and split else None
        check_mtp_copies(model, source, plan.parts if plan is not None else None)
        kept = tier_budgets(source, device, dtype, mtp, rank, world, tokens or DEFAULT_TOKENS, load, *budgets)
        tiers = Tiers(device, *kept)
        if load is not None:
            load.kept = kept
        return Loaded(model.eval(), tokenizer, source, label, device, True, plan, progress, load, tiers)
    if dist is not None and split:
        model, plan = parallel.load_parallel(source, device, dtype, group, mtp=mtp)
        return Loaded(model, tokenizer, source, label, device, False, plan, load=load)
    return Loaded(load_model(source, device, dtype, mtp=mtp), tokenizer, source, label, device, load=load)


def open_checkpoint(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    stream: bool | None = False,
    progress=None,
    split: bool = True,
    group=None,
    mtp: bool | None = None,
    tokens: int | None = None,
    budgets: tuple[int | None, int | None] = (None, None),
) -> Loaded:
    directory = resolve_checkpoint(path)
    source = SafetensorsSource(directory)
    tokenizer = Tokenizer(directory) if (directory / "tokenizer.json").exists() else None
    label = "demo" if directory == DEMO else str(directory)
    return open_source(source, label, tokenizer, device, dtype, stream, progress, split, group, mtp, tokens, budgets)


def open_synthetic(
    config: str | Path,
    n_layers: int | None = None,
    device="cpu",
    dtype=torch.bfloat16,
    stream: bool | None = False,
    progress=None,
    split: bool = True,
    group=None,
    tokens: int | None = None,
    budgets: tuple[int | None, int | None] = (None, None),
) -> Loaded:
    try:
        source = synthetic_source(config, n_layers)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    return open_source(
        source, f"synthetic:{config}", None, device, dtype, stream, progress, split, group, tokens=tokens, budgets=budgets
    )


def load(checkpoint: str | Path = "demo", device: str = "cpu", dtype: str = "bfloat16", stream: bool | None = False) -> Loaded:
    """A checkpoint (``demo``: the bundled one) ready to trace from Python or a notebook:
    ``tracing.load("demo").run("It is a truth", record="all")``. ``stream``: weights read while
    they run (None: when the checkpoint does not fit in memory)."""
    return open_checkpoint(checkpoint, device, parse_dtype(dtype), stream)
