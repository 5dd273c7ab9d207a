"""Scales that show the bulk of the data: a heat map stops below a dominating token and says so, and
shares are drawn on a scale fitted to their range (the figures built from a real trace)."""

from __future__ import annotations

import numpy as np
import pytest

from app.topics import attention, residual
from app.topics.figures import robust_top
from app.topics.tokens import position_labels
from tracing import TraceRequest, run
from tracing.tables import tables


@pytest.fixture(scope="module")
def trace(tiny_model):
    traced = run(tiny_model, TraceRequest(token_ids=[7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]))
    for name in [n for n in traced.tensors if n.endswith(("resid_pre", "resid_mid", "resid_post"))]:
        value = traced.tensors[name].clone()
        value[0] *= 300.0  # the first token's stream dominates, as in the real checkpoints
        traced.tensors[name] = value
    return traced


def test_the_stream_norm_stops_below_a_dominating_first_token_and_names_it(trace):
    grids = residual.residual_grids(tables(trace)["residual"], trace.n_tokens)
    labels = position_labels(trace)
    fig = residual.residual_norms_figure(grids, labels)
    heat = fig.data[0]
    assert heat.zmax < float(np.nanmax(grids.norm)) / 10  # the bulk of the positions spans the colours
    assert f"{labels[0]} above the scale" in fig.layout.title.text and "marked ▲" in fig.layout.title.text
    marked = np.asarray(heat.text)
    assert (marked[:, 0] == "▲").all() and (marked[:, 1:] == "").all()  # the mark the title promises, where it says


def test_a_scale_without_an_outlier_is_the_datas_own():
    z = np.arange(20, dtype=float).reshape(4, 5) + 1
    top, outliers = robust_top(z)
    assert top is None and not outliers.any()


def test_recall_is_drawn_on_a_scale_fitted_to_its_range(trace):
    got = attention.recall_grid(tables(trace)["indexer_recall"], trace.n_tokens)
    fig = attention.recall_figure(got[0], got[1], position_labels(trace))
    low = float(np.nanmin(got[1]))
    assert fig.data[0].zmax == 1 and low - 0.01 <= fig.data[0].zmin <= low
    assert f"colours {fig.data[0].zmin:g} to 1" in fig.layout.title.text
