"""``python -m tracing serve``: a model loaded once, traced by HTTP requests (tracing.server).

    python -m tracing serve --checkpoint demo                                  # http://127.0.0.1:8600
    torchrun --nproc-per-node 8 -m tracing serve --checkpoint /models/DeepSeek-V3.2-Exp --device cuda

Under torchrun every rank loads its part once (tensor and expert parallel, as ``run`` splits it),
rank 0 serves HTTP and hands each request to every rank. Loopback only unless ``--token-file``
names a bearer token; the limits bound what one request may cost. SIGTERM (or Ctrl-C) ends the
request running at its next block and stops every rank.
"""

from __future__ import annotations

import argparse
import ipaddress
import signal
import sys
import threading
import time
from datetime import timedelta

from ..bearer import read_token_file
from ..errors import InputError
from .inputs import finite, integer, named_path
from .loading import add_device_options, add_source_options, open_from_args, parse_device, parse_dtype

DEFAULT_PORT = 8600


def add_parser(sub) -> None:
    serve = sub.add_parser("serve", help="keep a model loaded and trace requests over HTTP (the app, run --server, Python)")
    add_source_options(serve, "synthetic weights of this config (no download)")
    add_device_options(serve)
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default loopback; any other needs --token-file)"
    )
    serve.add_argument("--port", type=integer(0, 65535), default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    serve.add_argument(
        "--token-file", type=named_path, help="file holding the bearer token every client must send (Authorization: Bearer ...)"
    )
    serve.add_argument(
        "--max-prompt-tokens", type=integer(), default=4096, help="longest prompt a request may bring (default 4096)"
    )
    serve.add_argument("--max-generate", type=integer(), default=512, help="most tokens a request may generate (default 512)")
    serve.add_argument(
        "--max-gradient-tokens",
        type=integer(),
        default=1024,
        help="longest prompt of a request with gradient_of, whose backward keeps every block's T x T attention (default 1024)",
    )
    serve.add_argument("--max-body-mb", type=finite, default=64.0, help="largest request body, patches included (default 64)")
    serve.add_argument("--max-patch-mb", type=finite, default=64.0, help="largest patches of a request (default 64)")
    serve.add_argument("--max-seconds", type=finite, default=600.0, help="a request is stopped after this long (default 600)")
    serve.add_argument("--max-queue", type=integer(), default=8, help="requests that may wait for the model (default 8)")
    serve.add_argument(
        "--dictionaries",
        type=named_path,
        metavar="DIR",
        help="sparse dictionaries a request may name (run --dictionary NAME): DIR itself, or each subdirectory of it "
        "holding one (named by it); checked against the model when it loads",
    )
    serve.add_argument(
        "--collective-timeout",
        type=finite,
        default=60.0,
        help="under torchrun, once loaded: seconds a rank waits for another (default 60)",
    )
    serve.add_argument(
        "--load-timeout",
        type=finite,
        default=3600.0,
        help="under torchrun: seconds the ranks wait for the slowest to load its part (default 3600)",
    )
    serve.set_defaults(func=cmd_serve)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _limits(args: argparse.Namespace):
    from ..server.wire import Limits

    for flag, value in (
        ("--max-prompt-tokens", args.max_prompt_tokens),
        ("--max-generate", args.max_generate),
        ("--max-gradient-tokens", args.max_gradient_tokens),
        ("--max-body-mb", args.max_body_mb),
        ("--max-patch-mb", args.max_patch_mb),
        ("--max-seconds", args.max_seconds),
        ("--max-queue", args.max_queue),
        ("--collective-timeout", args.collective_timeout),
        ("--load-timeout", args.load_timeout),
    ):
        if not value > 0 or value != value or value == float("inf"):
            raise InputError(f"{flag} must be a positive finite number, not {value}")
    return Limits(
        max_body_bytes=int(args.max_body_mb * 2**20),
        max_patch_bytes=int(args.max_patch_mb * 2**20),
        max_prompt_tokens=args.max_prompt_tokens,
        max_generate=args.max_generate,
        max_gradient_tokens=args.max_gradient_tokens,
        max_seconds=args.max_seconds,
        max_queue=args.max_queue,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from model import parallel

    from ..server.ranks import faults_from_env, load_delay
    from ..server.worker import Model, follow, lead

    limits = _limits(args)
    if not 0 < args.port < 65536:
        raise InputError(f"--port {args.port}: choose 1..65535")
    if not _loopback(args.host) and args.token_file is None:
        raise InputError(f"--host {args.host} is reachable from other machines: name a --token-file (a bearer token)")
    token = read_token_file(args.token_file)
    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    # the load's collectives wait for the slowest rank's reading (minutes on a node); the short timeout after it
    distributed = parallel.init_distributed(device, timedelta(seconds=args.load_timeout))
    rank, world = (distributed.rank, distributed.world) if distributed is not None else (0, 1)
    stopping = threading.Event()
    http = _Http(args, limits, token) if rank == 0 else None

    def stop(signum, frame) -> None:
        if rank == 0:
            stopping.set()
            if http is not None and http.state.jobs.running is not None:
                http.state.jobs.running.cancel("the server is shutting down")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    broken = None
    try:
        time.sleep(load_delay(rank))
        loaded = open_from_args(args, device, dtype, tokens=args.max_prompt_tokens + args.max_generate)
        ranks = _ranks(distributed, args.collective_timeout, loaded.device)
        catalogue = {}
        if args.dictionaries is not None:
            from ..dictionary.features import load_catalogue

            catalogue = load_catalogue(args.dictionaries, loaded.model.args)
        model = Model(loaded, faults_from_env(rank), dictionaries=catalogue)
        if rank == 0:
            http.ready(model, _facts(loaded, world, limits, catalogue))
            print(f"serving {loaded.label} on http://{args.host}:{args.port} ({world} rank{'s' * (world > 1)})", file=sys.stderr)
            if loaded.load is not None:
                print(loaded.load.line(), file=sys.stderr)
            broken = lead(model, http.state.jobs, stopping, ranks=ranks)
        else:
            broken = follow(model, limits, ranks)
    finally:
        if http is not None:
            http.stop()
    if broken is None:
        return 0
    print(f"error: rank {rank} stops: {broken}", file=sys.stderr)
    if distributed is not None:
        torch.distributed.destroy_process_group()  # no barrier: the other ranks may be gone
    return 1


def _ranks(distributed, collective_timeout: float, device):
    """The ranks' control group, once every rank has loaded its part (tracing.server.ranks); the
    model's collectives get the short timeout from here on."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from ..server.ranks import Ranks

    if distributed is None:
        return Ranks()
    dist.barrier()  # under --load-timeout: the slowest rank's load
    short = timedelta(seconds=collective_timeout)
    distributed_c10d._set_pg_timeout(short, dist.group.WORLD)
    # longer than the model's timeout: a rank that failed inside a block waits here until the others'
    # collective times out and they come to agree that the ranks are out of step
    group = dist.new_group(backend="gloo", timeout=2 * short + timedelta(seconds=10))
    return Ranks(group, distributed.rank, distributed.world, device)


def _facts(loaded, world: int, limits, dictionaries: dict | None = None) -> dict:
    args = loaded.model.args
    tokenizer = loaded.tokenizer
    chat = None
    if tokenizer is None:
        chat = "the model has no tokenizer.json"
    else:
        from ..chat import encode_chat
        from ..tokenizer import TokenizerError

        try:
            encode_chat(tokenizer, "")
        except TokenizerError as exc:
            chat = str(exc).partition(":")[0]
    health = {
        "model": loaded.label,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "device": str(loaded.device),
        "ranks": world,
        "stream": loaded.stream,
        "load": None if loaded.load is None else loaded.load.describe(),  # held or streamed, and the plan
    }
    info = {
        **health,
        "config": args.to_hf(),
        "tokenizer": tokenizer is not None,
        "chat_refusal": chat,
        "limits": limits.describe(),
    }
    if dictionaries:
        from ..dictionary.features import describe_catalogue

        info["dictionaries"] = describe_catalogue(dictionaries)
    return {"health": health, "info": info}


class _Http:
    """uvicorn on a thread of rank 0, serving the app of tracing.server.http."""

    def __init__(self, args, limits, token):
        import uvicorn

        from ..server.http import State, make_app
        from ..server.worker import Queue

        self.state = State(limits, Queue(limits.max_queue), token)
        config = uvicorn.Config(make_app(self.state), host=args.host, port=args.port, log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="anatomy-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise InputError(f"cannot listen on {args.host}:{args.port} (in use, or not an address of this machine)")
            time.sleep(0.05)

    def ready(self, model, facts: dict) -> None:
        self.state.facts = facts
        self.state.model = model

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
