"""docs/notebook.ipynb runs as a user runs it (a Jupyter kernel, cell by cell), so it cannot rot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "docs" / "notebook.ipynb"


def test_the_example_notebook_runs_and_answers_its_questions(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), "kept without outputs"
    where = {"metadata": {"path": str(tmp_path)}}  # outside the repository, as a user's notebook
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3", resources=where)
    client.execute()  # raises CellExecutionError, with the cell and its traceback, when a cell fails
    shown = "\n".join(
        str(out.get("text") or out.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    )
    assert "Wentworth" in shown and "correlation of attributed and measured" in shown and "KL(dense || sparse)" in shown
    figures = [out for cell in notebook.cells if cell.cell_type == "code" for out in cell.outputs if "data" in out]
    assert any("application/vnd.plotly.v1+json" in out["data"] for out in figures)  # the app's figures, drawn in the notebook
