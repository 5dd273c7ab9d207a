"""A checkpoint's own files: which paths it may name, and JSON read with bounds.

Every file a checkpoint directory names (its config, index, shards, tokenizer files) is read only
when it lies inside that directory, so a crafted index cannot make a loader read a file elsewhere;
the one exception is the Hugging Face cache, whose snapshot files are symlinks into the
``blobs/`` folder of the same ``models--*`` tree. JSON is read with a size and a nesting bound, so
a small crafted file costs little and is refused with a line instead of a RecursionError.

Both tracing/ and app/ read through here; nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

MAX_DEPTH = 64  # real configs and indexes nest 3 or 4 deep
CONFIG_BYTES = 16 << 20  # config.json, generation_config.json, tokenizer_config.json (real ones: a few KB)
INDEX_BYTES = 256 << 20  # model.safetensors.index.json (the 671B model's: about 9 MB)

# a string, or the rest of the text after an unclosed quote: it never fails, so the scan stays linear
_STRING = re.compile(r'"(?:[^"\\]++|\\.)*+"?', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


class FileError(ValueError):
    """A file refused before it is used: outside its checkpoint, too large, not JSON, or nested too deeply.
    Messages do not name the file: callers prefix its path."""


def snapshot_tree(directory: Path) -> Path | None:
    """The ``models--*`` folder around a Hugging Face cache snapshot (``models--*/snapshots/<rev>``), or None."""
    parent = directory.parent
    if parent.name == "snapshots" and parent.parent.name.startswith("models--"):
        return parent.parent
    return None


def confined(directory: str | os.PathLike, name: Any) -> Path:
    """``directory / name`` when ``name`` is a plain relative name whose file resolves inside the
    directory (or inside its Hugging Face cache tree); FileError otherwise."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FileError(f"{name!r} is not a file name")
    pure = PurePosixPath(name)
    if pure.is_absolute() or ".." in pure.parts:
        raise FileError(f"{name!r} is not a plain relative name (no absolute path, no '..')")
    root = Path(directory).resolve()
    path = Path(directory) / name
    resolved = path.resolve()
    tree = snapshot_tree(root)
    if not (resolved.is_relative_to(root) or (tree is not None and resolved.is_relative_to(tree))):
        where = f"{root} (or its cache tree {tree})" if tree is not None else str(root)
        raise FileError(f"{name} resolves to {resolved}, outside the checkpoint directory {where}")
    return path


def loads(text: str, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, refusing arrays and objects nested deeper than ``max_depth`` before parsing
    (the parser would recurse once per level)."""
    depth = 0
    for match in _BRACKET.finditer(_STRING.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        if depth > max_depth:
            raise FileError(f"JSON nested more than {max_depth} levels deep")
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise FileError(f"not valid JSON ({exc})") from None


def read_json(path: str | os.PathLike, max_bytes: int = CONFIG_BYTES) -> Any:
    """A JSON file of at most ``max_bytes``. FileNotFoundError passes through (callers say what is
    missing); anything else unreadable is a FileError."""
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise FileError(f"cannot read it ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise FileError(f"larger than {max_bytes >> 20} MiB, too large for this file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FileError(f"not UTF-8 ({exc})") from None
    return loads(text)
