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


def test_an_editable_install_makes_the_project_importable_anywhere(tmp_path):
    """``pip install -e .`` (no dependencies fetched: they are this environment's), then a
    notebook's imports from a directory outside the repository, the demo found through them."""
    import subprocess
    import sys

    prefix = tmp_path / "prefix"
    install = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--prefix", str(prefix)]
    subprocess.run([*install, "-e", str(REPO)], check=True, capture_output=True, timeout=300, cwd=tmp_path)
    (site,) = prefix.glob("lib/python*/site-packages")
    script = (
        f"import site; site.addsitedir({str(site)!r})\n"
        "import model, tracing, app.topics.figures\n"
        "from tracing.cli.loading import DEMO\n"
        "print(tracing.__file__, DEMO.is_dir())\n"
    )
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 0, out.stderr
    where, demo = out.stdout.split()
    assert Path(where).resolve() == REPO / "tracing" / "__init__.py" and demo == "True"
