"""Shared fixtures: the tiny config as a random model and as an FP8 checkpoint over two shards."""

from __future__ import annotations

import os

import pytest

from tests import rewritten


def pytest_sessionstart(session: pytest.Session) -> None:
    if session.config.pluginmanager.has_plugin("dsession"):
        # pytest-xdist's controller runs no test: it loads no torch (seconds on one core while the
        # other idles) and rewrites the test files' asserts once for the workers
        rewritten.prepare(session.config)
        return
    from tracing.startup import load_torch

    load_torch()  # before any test module imports torch: its idle OpenMP threads sleep (tracing.startup)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        # the workers share the cores: one torch thread each in the main thread, so that no parallel
        # region waits on a thread another worker's process holds (a test that needs more sets its
        # own, tests/model/test_threads.py; the values do not depend on the count)
        torch.set_num_threads(1)


# The files that take longest (docs/testing.md), started first: pytest-xdist hands each worker a
# whole file at a time in the order collected (pyproject's --no-loadscope-reorder keeps this order
# rather than the largest files by test count first), and a long file begun last leaves the other
# workers idle at the end.
FIRST = (
    "tests/app/test_browser.py",
    "tests/tracing/test_server.py",
    "tests/tracing/cli/test_cli.py",
    "tests/tracing/test_plan.py",
    "tests/app/test_app_server.py",
    "tests/tracing/atlas/test_atlas.py",
    "tests/model/test_parallel.py",
    "tests/model/test_threads.py",
    "tests/app/test_app_interventions.py",
    "tests/tracing/test_server_commands.py",
    "tests/model/test_real_width.py",
    "tests/model/test_stream.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {path: i for i, path in enumerate(FIRST)}
    items.sort(key=lambda item: order.get(item.nodeid.split("::", 1)[0], len(order)))  # stable: a file keeps its order


@pytest.fixture(autouse=True)
def _seeded():
    """Every test draws the same random numbers, whatever ran before it."""
    import torch

    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny_source():
    from model import TINY
    from model.synthetic import SyntheticSource

    return SyntheticSource(TINY, seed=1)


@pytest.fixture(scope="session")
def tiny_model(tiny_source):
    from model.checkpoint import load_model

    return load_model(tiny_source)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tiny_source):
    """The tiny source written in the checkpoint's layout: each tensor in its checkpoint dtype, at
    that dtype's full precision (float32 norm gains are not bfloat16 values)."""
    from model import TINY
    from model.checkpoint import save_checkpoint

    directory = tmp_path_factory.mktemp("ckpt") / "tiny"
    return save_checkpoint({n: tiny_source.load(n) for n in tiny_source.specs()}, TINY, directory, n_shards=2)


@pytest.fixture()
def tokens():
    import torch

    from model import TINY

    return torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="session")
def app_checkpoint(tmp_path_factory) -> str:
    """The bundled demo, or a tiny checkpoint with a tokenizer while assets/demo is absent."""
    from tests.devcheckpoint import demo_or_dev_checkpoint

    return demo_or_dev_checkpoint(tmp_path_factory.mktemp("app"))


@pytest.fixture
def env_read_once(monkeypatch):
    """``setting(name, value, reader)`` sets (or, with None, removes) an environment variable as a
    process starting now would find it: ``reader``, the lru_cached function that reads it once per
    process, is cleared now and after the test."""
    readers = []

    def setting(name: str, value: str | None, reader) -> None:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
        reader.cache_clear()
        readers.append(reader)

    yield setting
    monkeypatch.undo()
    for reader in readers:
        reader.cache_clear()
