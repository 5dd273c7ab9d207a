"""What the operator sets in the environment, read when needed (a test or a restart may change it),
with the defaults that apply when nothing is set."""

from __future__ import annotations

import math
import os
from pathlib import Path

import streamlit as st

from tracing.cli.loading import resolve_checkpoint

ENV_CHECKPOINT = "ANATOMY_CHECKPOINT"  # the default checkpoint: 'demo' (assets/demo) or a directory
ENV_MAX_TOKENS = "ANATOMY_MAX_TOKENS"  # the longest prompt the app traces
ENV_DEVICE = "ANATOMY_DEVICE"  # cpu | cuda (default: cuda when available)
ENV_THREADS = "ANATOMY_THREADS"  # CPU threads for a trace's large products (default: torch's count); set per trace
# os.pathsep-separated directories the "Checkpoint directory" field may name ('demo' names the bundled
# one); unset: any directory, as suits one person on their own machine
ENV_CHECKPOINT_ROOTS = "ANATOMY_CHECKPOINT_ROOTS"
ENV_MAX_UPLOAD_MB = "ANATOMY_MAX_UPLOAD_MB"  # the largest trace file the app reads (default: server.maxUploadSize)
ENV_SERVER = "ANATOMY_SERVER"  # a model server's URL (python -m tracing serve): the sidebar's "Model server" source
ENV_SERVER_TOKEN_FILE = "ANATOMY_SERVER_TOKEN_FILE"  # the file holding that server's bearer token
MAX_TOKENS = 512
# longer than the demo's index_topk, so the sparse attention visibly prunes (90 tokens on the demo)
DEFAULT_PROMPT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want of a wife. "
    "However little known the feelings or views of such a man may be on his first entering a neighbourhood, this truth is "
    "so well fixed in the minds of the surrounding families, that he is considered the rightful property of some one or "
    "other of their daughters."
)
DTYPES = ("bfloat16", "float32")


def default_checkpoint() -> str:
    return os.environ.get(ENV_CHECKPOINT, "").strip() or "demo"


def server_url() -> str:
    """ANATOMY_SERVER, or "" when no server is named."""
    return os.environ.get(ENV_SERVER, "").strip()


def server_token_file() -> str | None:
    return os.environ.get(ENV_SERVER_TOKEN_FILE, "").strip() or None


def default_source() -> str:
    """The sidebar's first source: the model server when one is named, else the bundled demo."""
    return "server" if server_url() else "demo"


def named_roots() -> list[str]:
    """The directories ANATOMY_CHECKPOINT_ROOTS names, as written."""
    return [part.strip() for part in os.environ.get(ENV_CHECKPOINT_ROOTS, "").split(os.pathsep) if part.strip()]


def checkpoint_roots() -> list[Path] | None:
    """The directories checkpoints may come from, symlinks resolved, or None: no restriction. The
    bundled demo and the operator's default checkpoint are always among them."""
    if not os.environ.get(ENV_CHECKPOINT_ROOTS, "").strip():
        return None
    roots = []
    for value in (*named_roots(), "demo", default_checkpoint()):
        root = resolve_checkpoint(value)
        roots += [Path(os.path.abspath(root)), root.resolve()]
    return list(dict.fromkeys(roots))


def max_upload_bytes() -> int:
    """The largest trace file the app reads: ANATOMY_MAX_UPLOAD_MB, or the server's own limit."""
    server = float(st.get_option("server.maxUploadSize"))  # megabytes, as Streamlit counts them: MiB
    try:
        megabytes = float(os.environ.get(ENV_MAX_UPLOAD_MB, "").strip() or server)
    except ValueError:
        megabytes = server
    if not math.isfinite(megabytes) or megabytes <= 0:
        megabytes = server
    return int(megabytes * 2**20)


def max_tokens() -> int:
    try:
        return max(1, int(os.environ.get(ENV_MAX_TOKENS, MAX_TOKENS)))
    except ValueError:
        return MAX_TOKENS


def device() -> str:
    import torch

    wanted = os.environ.get(ENV_DEVICE, "").strip()
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


def threads() -> int | None:
    """ANATOMY_THREADS, when it names a thread count."""
    wanted = os.environ.get(ENV_THREADS, "").strip()
    return int(wanted) if wanted.isdigit() and int(wanted) > 0 else None
