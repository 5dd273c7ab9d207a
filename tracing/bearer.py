"""The bearer token of a model server: one rule for the file that holds it, read by ``serve``
(``--token-file``) and by every client (``run --server --token-file``, ANATOMY_SERVER_TOKEN_FILE).

A token travels in an HTTP header, which carries printable ASCII only: a token of other characters
would be taken by the server and sendable by no client, so it is refused where it is read. The file
is opened without blocking and read no further than MAX_BYTES: a FIFO, a device (/dev/zero), a
directory or a large file is refused at once instead of blocking or filling memory. A file every
user can read gives the token away: said on stderr, in one line.
"""

from __future__ import annotations

import os
import stat
import sys

from .errors import InputError

MAX_BYTES = 4096  # a token is tens of characters; a file larger than this is not a token file
MIN_CHARS = 16


def read_token_file(path: str | os.PathLike | None, what: str = "--token-file") -> str | None:
    """The token in the file at ``path`` (surrounding whitespace stripped), or None for no path;
    InputError naming ``what`` (the flag or variable that gave the path) when it is no token file."""
    if path is None:
        return None
    where = f"{what} {os.fspath(path)}"
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    try:
        st = os.fstat(fd)  # the file opened, not the path again: nothing can swap it in between
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{where}: is a directory, not a token file")
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{where}: not a regular file (a FIFO or a device?): a token file is a small regular file")
        data = _read_at_most(fd, MAX_BYTES + 1)
    except OSError as exc:
        raise InputError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_BYTES:
        raise InputError(f"{where}: more than {MAX_BYTES:,} bytes; a token file holds one token")
    try:
        token = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise InputError(f"{where}: holds non-ASCII bytes; a token is printable ASCII, as HTTP headers are") from None
    check_token(token, where)
    if st.st_mode & stat.S_IROTH:
        print(f"warning: {where}: every user of this machine can read it (chmod 600 it)", file=sys.stderr)
    return token


def check_token(token: str, where: str = "the token") -> str:
    """``token`` when it can be a bearer token: MIN_CHARS or more printable ASCII characters."""
    if len(token) < MIN_CHARS or not all("!" <= c <= "~" for c in token):
        raise InputError(f"{where}: the token must be at least {MIN_CHARS} printable ASCII characters, without spaces")
    return token


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit and (chunk := os.read(fd, limit - size)):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)
