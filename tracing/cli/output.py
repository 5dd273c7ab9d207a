"""Writing output files and table directories so that a failure leaves nothing half-written.

Everything one command writes (a trace file and its CSV directory, say) is staged under temporary
names beside the targets and moved into place only once all of it is complete; any failure
removes the staged files and the directories made for them. A directory inside another new one
(``--out-dir X --csv X/tables``) is staged within that one's staging and arrives with it. An existing
regular file is replaced;
anything else at a target path (a symlink, FIFO, device, directory) is refused rather than
silently turned into a regular file. Every failure is an ``OutputError``: one line naming the path
and the operating system's reason, which the command line reports with exit status 2.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from ..errors import InputError

# what --csv's help says of a table directory used before (TableDirectory's stale files)
REUSED = (
    " (a reused directory loses the table files of an earlier run, tokens.csv, router.parquet and the like, "
    "that this one does not write; other files stay)"
)


class OutputError(InputError):
    """An output path that cannot be written."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


def _kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symlink"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "something else"


def _lstat(path: Path) -> os.stat_result | None:
    """The path's own status, None when nothing is there (or its parent is no directory: then
    creating it fails later with the reason)."""
    try:
        return path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None


def _named(path: str | os.PathLike) -> Path:
    """An empty path (an unset variable in ``--out "$DIR"``) would be the current directory."""
    if not os.fspath(path):
        raise OutputError("an empty path names no output: give a file or directory")
    return Path(path)


def check_file(path: str | os.PathLike) -> Path:
    """Refuse a file target that exists and is not a regular file: replacing it by rename would
    turn a FIFO, device or symlink into a regular file without a word."""
    path = _named(path)
    st = _lstat(path)
    if st is not None and (kind := _kind(st.st_mode)):
        raise OutputError(f"{path}: exists and is {kind}, not a regular file; refusing to replace it")
    return path


def check_directory(path: str | os.PathLike) -> Path:
    """Refuse a directory target that exists and is not a directory (a symlink to one is fine)."""
    path = _named(path)
    if _lstat(path) is not None and not path.is_dir():
        raise OutputError(f"{path}: exists and is not a directory")
    return path


def _unique(parent: Path, name: str, make: Callable[[Path], None]) -> Path:
    """A new hidden entry beside the target, made by ``make`` (which must fail if it exists)."""
    for _ in range(100):
        tmp = parent / f".{name}.{secrets.token_hex(4)}.tmp"
        try:
            make(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(errno.EEXIST, "no free temporary name", str(parent))


def _new_file(path: Path) -> None:
    # mode 0o666 under the umask, as any new file gets (tempfile.mkstemp would give 0600)
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666))


def _new_dir(path: Path) -> None:
    os.mkdir(path, 0o777)


class TableDir:
    """A directory being staged: files written here go into ``target`` on commit."""

    def __init__(self, target: Path, staging: Path, fresh: bool, stale: frozenset[str], within: bool = False):
        self.target, self.staging, self.fresh, self.stale = target, staging, fresh, stale
        self.within = within  # staged inside another new directory's staging: it arrives with that one
        self.names: list[str] = []

    def write(self, name: str, fill: Callable[[Path], object]) -> Path:
        """``fill(path)`` writes the file; returns the path it will have once committed."""
        try:
            fill(self.staging / name)
        except OSError as exc:
            raise OutputError(f"{self.target / name}: cannot write ({_reason(exc)})") from None
        self.names.append(name)
        return self.target / name


class Outputs:
    """Files and directories written together: ``with Outputs() as out: out.file(...); ...``
    commits when the block completes and leaves nothing of it when the block raises."""

    def __init__(self):
        self._files: list[tuple[Path, Path]] = []  # (staged, target)
        self._dirs: list[TableDir] = []
        self._made: list[Path] = []  # parent directories made for the targets, in creation order
        self._targets: set[Path] = set()

    def __enter__(self) -> Outputs:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    def _claim(self, path: Path) -> None:
        key = Path(os.path.abspath(path))
        if key in self._targets:
            raise OutputError(f"{path}: given for two outputs")
        self._targets.add(key)

    def _parents(self, path: Path) -> None:
        missing = []
        parent = path.parent
        while _lstat(parent) is None and parent != parent.parent:
            missing.append(parent)
            parent = parent.parent
        for directory in reversed(missing):
            try:
                os.mkdir(directory)
            except OSError as exc:
                raise OutputError(f"{path}: cannot write ({directory}: {_reason(exc)})") from None
            self._made.append(directory)

    def file(self, path: str | os.PathLike, data: bytes) -> Path:
        """Stage ``data`` for ``path``."""
        path = check_file(path)
        self._claim(path)
        self._parents(path)
        try:
            tmp = _unique(path.parent, path.name, _new_file)
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
        self._files.append((tmp, path))
        try:
            with open(tmp, "wb") as f:
                f.write(data)
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
        return path

    def directory(self, path: str | os.PathLike, stale: Iterable[str] = ()) -> TableDir:
        """Stage a directory of files. A new one appears whole; into an existing one the files are
        moved, and the regular files named in ``stale`` that this write did not replace are
        removed, so the directory holds only this write's files of those names."""
        path = check_directory(path)
        self._claim(path)
        outer = self._new_dir_holding(path)
        if outer is not None:  # --out-dir X --csv X/tables, X new: the tables are staged in X's staging
            staging = outer.staging / Path(os.path.abspath(path)).relative_to(os.path.abspath(outer.target))
            try:
                staging.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
            staged = TableDir(path, staging, True, frozenset(stale), within=True)
            self._dirs.append(staged)
            return staged
        fresh = not path.exists()
        if fresh:
            self._parents(path)
        where = path.parent if fresh else path  # inside an existing one: the same file system
        try:
            staging = _unique(where, path.name if fresh else "staging", _new_dir)
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
        staged = TableDir(path, staging, fresh, frozenset(stale))
        self._dirs.append(staged)
        return staged

    def _new_dir_holding(self, path: Path) -> TableDir | None:
        """The new directory staged here that ``path`` lies inside, if any."""
        where = Path(os.path.abspath(path))
        for staged in self._dirs:
            if staged.fresh and not staged.within and where.is_relative_to(os.path.abspath(staged.target)):
                return staged
        return None

    def _check(self) -> None:
        """Everything that can be checked before the first move, so a refusal moves nothing."""
        for staged in self._dirs:
            if staged.within:
                continue
            if staged.fresh:
                if _lstat(staged.target) is not None:
                    raise OutputError(f"{staged.target}: appeared while writing; not replacing it")
                continue
            for name in staged.names:
                check_file(staged.target / name)
        for _, target in self._files:
            check_file(target)

    def commit(self) -> None:
        try:
            self._check()
        except BaseException:
            self.discard()
            raise
        placed: list[Path] = []  # new entries, removed again if a later move fails
        try:
            for staged in self._dirs:
                if staged.within:
                    continue
                if staged.fresh:
                    _move(staged.staging, staged.target)
                    placed.append(staged.target)
                    continue
                for name in staged.names:
                    new = _lstat(staged.target / name) is None
                    _move(staged.staging / name, staged.target / name)
                    if new:
                        placed.append(staged.target / name)
                for name in sorted(staged.stale - set(staged.names)):
                    old = staged.target / name
                    if (st := _lstat(old)) is not None and stat.S_ISREG(st.st_mode):
                        _remove(old)
                _remove_tree(staged.staging)
            for tmp, target in self._files:  # the trace last: it stands for a complete run
                new = _lstat(target) is None
                _move(tmp, target)
                if new:
                    placed.append(target)
        except BaseException:
            for path in reversed(placed):
                if path.is_dir() and not path.is_symlink():
                    _remove_tree(path)
                else:
                    path.unlink(missing_ok=True)
            self.discard()
            raise
        self._files, self._dirs, self._made = [], [], []

    def discard(self) -> None:
        for tmp, _ in self._files:
            tmp.unlink(missing_ok=True)
        for staged in self._dirs:
            _remove_tree(staged.staging)
        for directory in reversed(self._made):
            try:
                directory.rmdir()
            except OSError:
                pass
        self._files, self._dirs, self._made = [], [], []


def _move(src: Path, dst: Path) -> None:
    """Rename ``src`` onto ``dst``; an existing regular file keeps its permissions (new entries
    were made under the umask)."""
    try:
        if (st := _lstat(dst)) is not None and stat.S_ISREG(st.st_mode):
            os.chmod(src, stat.S_IMODE(st.st_mode))
        os.replace(src, dst)
    except OSError as exc:
        raise OutputError(f"{dst}: cannot write ({_reason(exc)})") from None


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OutputError(f"{path}: cannot remove the previous run's file ({_reason(exc)})") from None


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def write_file(path: str | os.PathLike, data: bytes) -> Path:
    """Write one file atomically (see the module's docstring)."""
    with Outputs() as out:
        return out.file(path, data)
