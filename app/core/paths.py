"""The paths a visitor gives the app, confined: the one rule every field that names a file on the server
goes through (the checkpoint directory, the atlas directory) and every directory the app makes for an
upload (a zipped atlas unpacked).

Under ANATOMY_CHECKPOINT_ROOTS (a shared deployment) a typed path opens only under the roots the
operator named, and every refusal of a field reads the same, whether the path exists, is a file, or
holds damaged files: a reason would tell what exists on the server or quote what its files hold. The
reason goes to the server log. Without the roots the app serves one person on their own machine and
says exactly what is wrong.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

from tracing.errors import InputError

from . import settings
from .markup import escape_md

log = logging.getLogger(__name__)


class Refused(InputError):
    """A path the deployment does not open; the message is the field's one refusal."""


def refusal(what: str) -> str:
    """The one answer a field gives under the roots: ``what`` is what the field opens ("a loadable checkpoint")."""
    return f"not {what} under the allowed roots (the server log says why)"


def confined() -> bool:
    """Whether this deployment confines paths (ANATOMY_CHECKPOINT_ROOTS is set)."""
    return settings.checkpoint_roots() is not None


def roots_help(what: str) -> str:
    """A field's help, continued: where this server opens ``what`` ("checkpoints"), when its operator
    confined it."""
    named = settings.named_roots()
    return f". This server opens {what} only under: " + ", ".join(escape_md(p) for p in named) if named else ""


def confine(path: Path, what: str, holds: str) -> Path:
    """The real directory ``path`` names, when it lies under a root (as typed, '..' folded, and with its
    symlinks resolved) and holds the file ``holds``; else :class:`Refused`. Nothing outside the roots is
    looked at beyond resolving its symlinks. Without roots, ``path`` as given."""
    roots = settings.checkpoint_roots()
    if roots is None:
        return path
    lexical = Path(os.path.abspath(path))  # '..' folded without touching the disk
    if not any(lexical.is_relative_to(root) for root in roots):
        _refuse(what, path, f"outside {settings.ENV_CHECKPOINT_ROOTS}")
    try:
        real = path.resolve(strict=True)  # a symlink loop, a NUL byte, no permission: refused alike
        inside = any(real.is_relative_to(root) for root in roots)
        holding = inside and (real / holds).is_file()
    except (OSError, RuntimeError, ValueError) as exc:
        _refuse(what, path, str(exc))
    if not inside:
        _refuse(what, path, f"it resolves to {real}, outside {settings.ENV_CHECKPOINT_ROOTS}")
    if not holding:
        _refuse(what, path, f"{real} holds no {holds}")
    return real


@contextmanager
def refused_alike(what: str, value: object, errors: tuple[type[BaseException], ...]) -> Iterator[None]:
    """Under the roots, any of ``errors`` raised inside (opening what a confined path names) becomes the
    field's one refusal, its reason logged; without roots the errors pass as they are."""
    if not confined():
        yield
        return
    try:
        yield
    except Refused:
        raise
    except errors as exc:
        _refuse(what, value, str(exc))


def scrubbed(message: str, directory: str | os.PathLike, shown: str) -> str:
    """``message`` with the server's own ``directory`` (one the app made, e.g. for an upload) written as
    ``shown``, the name the visitor knows it by: a message never names where the server keeps things."""
    for form in dict.fromkeys((str(directory), os.path.realpath(directory))):
        message = message.replace(form + os.sep, shown + ": ").replace(form, shown)
    return message


def _refuse(what: str, value: object, reason: str) -> NoReturn:
    log.warning("%s %r refused: %s", what, value, reason)
    raise Refused(refusal(what)) from None
