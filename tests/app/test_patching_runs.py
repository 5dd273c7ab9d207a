"""The Patching page's runs without Streamlit (app.topics.patching_runs): putting back the clean stream
where the prompts differ restores the clean answer, a file of pairs gives each cell's mean over them,
one cell's patched run differs from the corrupt run from that position on, and a sweep without sites
is refused."""

from __future__ import annotations

import pytest
import torch

from app.core.models import open_model
from app.core.traces import request_for
from app.topics import patching as topic
from app.topics import patching_runs as runs
from tracing.analyses.patching import Cell
from tracing.errors import InputError

CLEAN, CORRUPT = "Anne had not seen Captain", "Anne had not seen Colonel"


@pytest.fixture(scope="module")
def om(app_checkpoint):
    return open_model(app_checkpoint, "bfloat16")


def test_the_clean_stream_put_back_where_the_prompts_differ_restores_the_answer(om):
    calls = []
    result = runs.run_sweep(om, CLEAN, CORRUPT, ["resid_pre"], positions="last", on_cell=lambda i, n: calls.append((i, n)))
    table, summary = result.table, result.summary
    (differs,) = summary["differing_positions"]
    assert summary["positions"] == [summary["tokens"] - 1] and differs == summary["tokens"] - 1
    assert len(table) == om.args.n_layers == len(calls) and (table["value"] == 1.0).all()


def test_the_gradient_method_estimates_the_same_cells(om):
    exact, gradient = (runs.run_sweep(om, CLEAN, CORRUPT, ["heads"], positions="last", method=m) for m in ("exact", "gradient"))
    keys = ["site", "block", "position", "index"]
    assert gradient.table[keys].equals(exact.table[keys]) and set(gradient.table["method"]) == {"gradient"}


def test_one_cells_patched_run_parts_from_the_corrupt_run_at_its_position(om):
    n = len(om.encode(request_for(om, CLEAN)))
    base, patched = runs.patched_cell(om, CLEAN, CORRUPT, Cell("resid_pre", 1, n - 1), "resid_pre 1")
    assert base.key.plain == patched.key.plain and base.key != patched.key
    a, b = base.trace["layers.1.resid_pre"], patched.trace["layers.1.resid_pre"]
    assert torch.equal(a[: n - 1], b[: n - 1]) and not torch.equal(a[n - 1], b[n - 1])


def test_a_sweep_without_sites_is_refused(om):
    with pytest.raises(InputError, match="at least one site"):
        runs.run_sweep(om, CLEAN, CORRUPT, [])


def test_a_file_of_pairs_gives_each_cells_mean_over_the_pairs(om):
    data = f"clean,corrupt\n{CLEAN},{CORRUPT}\nThe cat sat on the mat,The dog sat on the mat\n".encode()
    calls = []
    result = runs.run_pairs(om, data, "pairs.csv", ["resid_pre"], "last", on_pair=lambda i, n: calls.append((i, n)))
    table, each = result.table, result.each
    assert calls == [(0, 2), (1, 2)] and set(each["line"]) == {2, 3} and (table["n"] == 2).all()
    assert table["mean"].tolist() == pytest.approx(each.groupby("block")["value"].mean().tolist())
    frame, width, labels = topic.mean_grid(table, result.summary["tokens"])
    assert topic.grid(frame, "resid_pre", width)[0][:, -1].tolist() == pytest.approx(table["mean"].tolist())
    assert labels[-1] == ("-1" if result.summary["tokens"] is None else str(result.summary["tokens"] - 1))
    with pytest.raises(InputError, match="pairs.csv line 2: 1 cells where the header names 2"):
        runs.run_pairs(om, b"clean,corrupt\nno comma here\n", "pairs.csv", ["resid_pre"])
