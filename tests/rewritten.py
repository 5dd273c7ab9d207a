"""The test files' rewritten asserts, made once for pytest-xdist's workers.

pytest rewrites every ``assert`` of a test file (and of a conftest) to explain its failures, and keeps
the rewritten code in ``__pycache__``. Each worker collects every file, so on a fresh checkout, or
with ``PYTHONDONTWRITEBYTECODE`` set, each of the three rewrote all of them: about 7 CPU-seconds a
worker on the 2-core machine, half of its collection. xdist's controller runs no test; before it
starts the workers it rewrites the files on as many processes as there are cores (forked: nothing
to import again) and keeps them where pytest looks, so the workers read them. Where pytest's
private functions differ (another version), nothing is kept and the workers rewrite as before.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def prepare(config) -> None:
    """Rewrite, on the cores, the files not kept already; a failure leaves the rest to the workers."""
    if "fork" not in multiprocessing.get_all_start_methods():  # Windows: the workers rewrite, as before
        return
    try:
        from _pytest.assertion import rewrite

        state = config.stash[rewrite.assertstate_key]
        todo = [fn for fn in _test_files() if rewrite._read_pyc(fn, _pyc(rewrite, fn), state.trace) is None]
    except (ImportError, AttributeError, KeyError, TypeError):  # another pytest, or --assert=plain
        return
    if not todo:
        return
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cores = max(1, min(usable, len(todo)))
    fork = multiprocessing.get_context("fork")
    children = [fork.Process(target=_rewrite, args=(config, todo[i::cores]), daemon=True) for i in range(cores)]
    for child in children:
        child.start()
    for child in children:
        child.join(120)
        if child.is_alive():
            child.kill()


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name.startswith("test_") or p.name == "conftest.py")


def _pyc(rewrite, fn: Path) -> Path:
    return rewrite.get_cache_dir(fn) / (fn.name[:-3] + rewrite.PYC_TAIL)


def _rewrite(config, files: list[Path]) -> None:
    from _pytest.assertion import rewrite

    state = config.stash[rewrite.assertstate_key]
    for fn in files:
        pyc = _pyc(rewrite, fn)
        if rewrite.try_makedirs(pyc.parent):
            source_hash, code = rewrite._rewrite_test(fn, config)
            rewrite._write_pyc(state, code, source_hash, pyc)  # written aside, then renamed: a worker reads a whole file
