"""pyproject.toml declares what the requirements files (the README's install, CI's) install: one list, kept in two forms."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

REPO = Path(__file__).resolve().parents[1]


def requirements(name: str) -> list[str]:
    """The requirements a file adds, without comments and the files it includes (-r)."""
    lines = (line.split("#", 1)[0].strip() for line in (REPO / name).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("-r")]


def test_pyproject_declares_the_requirements_files():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == requirements("requirements.txt")
    assert project["optional-dependencies"]["dev"] == requirements("requirements-dev.txt")
