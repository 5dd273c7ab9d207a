"""Scales that show the bulk of the data, built from a real trace whose first token dominates (its
stream and its expert outputs hundreds of times the rest, as in the real checkpoints): each rule's
range leaves the outlier out, marks it and names it in the title; the first token can be left out."""

from __future__ import annotations

import numpy as np
import pytest

from app.topics import attention, experts, interventions, residual
from app.topics.figures import robust_range, robust_top
from app.topics.tokens import position_labels
from tracing import TraceRequest, run
from tracing.analyses.diff import diff_tables
from tracing.runner import trace_tokens
from tracing.tables import tables

TOKENS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]
LOUD = ("resid_pre", "resid_mid", "resid_post", "ffn.routed_out", "ffn.shared_out")


@pytest.fixture(scope="module")
def trace(tiny_model):
    traced = run(tiny_model, TraceRequest(token_ids=TOKENS, record=("all",)))
    for name in [n for n in traced.tensors if n.endswith(LOUD)]:
        value = traced.tensors[name].clone()
        value[0] *= 300.0  # the first token dominates, as in the real checkpoints
        traced.tensors[name] = value
    return traced


def test_the_stream_norm_stops_below_a_dominating_first_token_and_names_it(trace):
    grids = residual.residual_grids(tables(trace)["residual"], trace.n_tokens)
    labels = position_labels(trace)
    fig = residual.residual_norms_figure(grids, labels)
    heat = fig.data[0]
    assert heat.zmax < float(np.nanmax(grids.norm)) / 10  # the bulk of the positions spans the colours
    assert f"{labels[0]} beyond the scale" in fig.layout.title.text and "marked ▲" in fig.layout.title.text
    marked = np.asarray(heat.text)
    assert (marked[:, 0] == "▲").all() and (marked[:, 1:] == "").all()  # the mark the title promises, where it says
    assert heat.colorbar.ticktext[-1] == f"≥ {heat.zmax:.3g}"  # the colour bar's end says it stops there


def test_the_stream_norm_without_the_first_token_spans_the_rest(trace):
    grids = residual.residual_grids(tables(trace)["residual"], trace.n_tokens)
    fig = residual.residual_norms_figure(grids, position_labels(trace), skip_first=True)
    heat = fig.data[0]
    rest = grids.norm[:, 1:]
    assert heat.zmin == pytest.approx(np.nanmin(rest)) and heat.zmax == pytest.approx(np.nanmax(rest))
    assert np.isnan(np.asarray(heat.z, dtype=float)[:, 0]).all() and heat.text is None
    assert "position 0 left out" in fig.layout.title.text and "beyond the scale" not in fig.layout.title.text


def test_a_scale_without_an_outlier_is_the_datas_own():
    z = np.arange(20, dtype=float).reshape(4, 5) + 1
    top, outliers = robust_top(z)
    assert top is None and not outliers.any()
    scale = robust_range(z)
    assert (scale.lo, scale.hi, scale.clipped) == (1.0, 20.0, False)


def test_routed_and_shared_outputs_are_drawn_on_the_robust_scale(trace):
    block = next(i for i in range(trace.config.n_layers) if trace.config.is_moe(i))
    df = experts.routed_shared(trace, block)
    fig = experts.routed_shared_figure(df, block)
    top = fig.layout.yaxis.range[1]
    rest = df[["routed experts", "shared expert"]].to_numpy()[1:]
    assert rest.max() <= top < df[["routed experts", "shared expert"]].to_numpy()[0].max() / 10
    marks = next(t for t in fig.data if t.name == "beyond the scale")
    first = f"0 {df['token'][0]}"
    assert list(marks.x) == [first] and marks.marker.symbol == "triangle-up" and marks.text[0].startswith("▲")
    assert f"{first} beyond the scale" in fig.layout.title.text

    without = experts.routed_shared_figure(df, block, skip_first=True)
    assert first not in without.data[0].x and not any(t.name == "beyond the scale" for t in without.data)
    assert "position 0 left out" in without.layout.title.text


def test_the_block_updates_mark_the_bars_beyond_the_scale(trace):
    df = residual.block_updates(trace, 1)
    fig = residual.block_updates_figure(df, 1)
    assert any(t.name == "beyond the scale" for t in fig.data)
    assert fig.layout.yaxis.range[1] < df["stream"][0] and "beyond the scale" in fig.layout.title.text


def test_recall_is_drawn_on_a_scale_fitted_to_its_range(trace):
    got = attention.recall_grid(tables(trace)["indexer_recall"], trace.n_tokens)
    fig = attention.recall_figure(got[0], got[1], position_labels(trace))
    low = float(np.nanmin(got[1]))
    assert fig.data[0].zmax == 1 and low - 0.01 <= fig.data[0].zmin <= low
    assert f"colours {fig.data[0].zmin:g} to 1" in fig.layout.title.text


def test_the_expert_load_marks_an_expert_that_takes_most_tokens():
    counts = np.array([[2, 1, 3, 2, 60, 1, 2, 3], [1, 2, 2, 3, 1, 2, 3, 2]])
    fig = experts.expert_load_figure([1, 2], counts, None, 64)
    assert fig.data[0].zmax == 3 and np.asarray(fig.data[0].text)[0, 4] == "▲"
    assert "expert 4 beyond the scale (tokens up to 60" in fig.layout.title.text


def test_the_drift_heat_map_stops_below_the_edited_position_and_names_it(tiny_model):
    plain = trace_tokens(tiny_model, TOKENS)
    pushed = plain["layers.0.resid_post"].clone()
    pushed[5] *= 50.0  # one position's stream pushed far, the rest moved only through the attention
    edited = trace_tokens(tiny_model, TOKENS, patches={"layers.0.resid_post": pushed})
    moved = interventions.drift(diff_tables(plain, edited)["stream"], len(TOKENS))
    labels = position_labels(plain)
    fig = interventions.drift_figure(moved, labels)
    heat = fig.data[0]
    assert heat.zmin == 0 and heat.zmax < float(moved.rel_l2[:, 5].max()) / 10  # the bulk spans the colours
    assert f"; {labels[5]}" in fig.layout.title.text and "beyond the scale" in fig.layout.title.text
    marked = np.asarray(heat.text)
    assert ((marked == "▲") == (moved.rel_l2 > heat.zmax)).all() and (marked[:, 5] == "▲").sum() >= 1
    assert (marked[:, :5] == "").all() and heat.colorbar.ticktext[-1] == f"≥ {heat.zmax:.3g}"

    calm = interventions.drift(diff_tables(plain, trace_tokens(tiny_model, TOKENS))["stream"], len(TOKENS))
    same = interventions.drift_figure(calm, labels).data[0]  # nothing moved: no outlier, nothing marked
    assert same.text is None and "beyond the scale" not in interventions.drift_figure(calm, labels).layout.title.text
