"""The one registry of trace sites: the model's hook points, what a run records, and the docs agree with it."""

from pathlib import Path

import pytest
import torch

from model import TINY
from model.checkpoint import build_model
from tracing.runner import trace_tokens
from tracing.sites import (
    MAX_FEATURES,
    REGISTRY,
    analysis,
    hook_points,
    index_range,
    layer_site,
    markdown_table,
    select,
    site_name,
    site_shapes,
    spec,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_every_hook_point_of_the_model_is_a_registry_row_with_its_legend():
    model = build_model(TINY)  # a dense block, then MoE blocks
    points = hook_points(model)
    assert points
    for name, point in points.items():
        row = spec(name)
        assert row is not None, f"hook point {name} is not in tracing.sites.REGISTRY"
        assert row.legend == point.shape, name
        assert row.derived_from is None and row.patchable, name
    shapes = site_shapes(TINY)
    hooked = {name for name in shapes if spec(name).derived_from is None}
    assert hooked == set(points)  # and no registry row names a hook point the model lacks


def test_derived_rows_name_what_they_are_computed_from_and_how():
    suffixes = {row.suffix for row in REGISTRY}  # model-level rows' patterns too
    for row in REGISTRY:
        assert row.blocks in ("all", "moe", "model", "mtp"), row.pattern
        assert row.derived_from is None or row.derived_from in suffixes, row.pattern
        assert all(read in suffixes for read in row.reads), row.pattern
        assert not (row.derived_from and row.patchable), row.pattern
        # a derived row says how it is computed; a row computed by "derive" carries the function
        assert (row.derived_from is None) == (row.computed == ""), row.pattern
        assert (row.computed == "derive") == (row.derive is not None), row.pattern
        assert row.computed in ("", "derive", "lens", "next", "mtp", "attribution", "flow", "gradient", "features"), row.pattern


def test_integer_rows_carry_their_index_range_and_padded_rows_their_fill():
    """What a trace file's integer values are checked against, and what merged decode passes pad
    with, come from the rows: every integer row but the token ids says what its values index."""
    ranges = {row.pattern: row.index_range(TINY, 12) for row in REGISTRY if row.dtype == torch.int64}
    assert ranges == {
        "layers.{i}.attn.indexer.topk_indices": (-1, 12),
        "layers.{i}.ffn.gate.groups": (0, TINY.n_expert_groups),
        "layers.{i}.ffn.gate.topk_indices": (0, TINY.n_routed_experts),
        "layers.{i}.logit_lens.topk_indices": (0, TINY.vocab_size),
        "layers.{i}.ffn.expert_lens.ids": (-1, TINY.vocab_size),
        "next.topk_indices": (0, TINY.vocab_size),
        "mtp.topk_indices": (0, TINY.vocab_size),
        **{row.pattern: (-1, MAX_FEATURES) for row in REGISTRY if row.pattern.endswith(".features.top_ids")},
    }
    assert index_range(TINY, "layers.2.ffn.gate.topk_indices", 12) == (0, TINY.n_routed_experts)
    assert index_range(TINY, "layers.2.resid_pre", 12) is None
    fills = {row.suffix: row.fill for row in REGISTRY if row.fill != 0}
    assert fills == {"attn.indexer.scores": float("-inf"), "attn.scores": float("-inf"), "attn.indexer.topk_indices": -1}


def test_a_blocks_site_name_is_made_in_one_place_and_checked():
    assert site_name(3, "ffn.gate.topk_indices") == "layers.3.ffn.gate.topk_indices"
    with pytest.raises(KeyError, match="no trace site"):
        site_name(3, "ffn.gate.topk_index")  # a typo fails, it does not silently match nothing


def test_every_recorded_site_is_in_the_registry_with_its_dtype(tiny_model):
    trace = trace_tokens(tiny_model, [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3], record="all")
    assert len(trace.tensors) > 50
    for name, value in trace.tensors.items():
        if name == "tokens":
            continue
        row = spec(name)
        assert row is not None, f"recorded site {name} is not in tracing.sites.REGISTRY"
        assert value.dtype == row.dtype, name
        where = layer_site(name)
        assert where is None or trace.site(*where) is value


def test_the_docs_table_is_the_registry():
    assert markdown_table() in DOCS.read_text(), "docs/cli.md's site table differs from tracing.sites.markdown_table()"


def test_a_broad_pattern_takes_the_models_sites_not_a_gradients_or_a_dictionarys():
    broad = select(TINY, "layers.*")
    assert broad and not any(analysis(n) in ("gradient", "features") for n in broad)
    asked = select(TINY, "layers.1.*.features.*")
    assert asked and {analysis(n) for n in asked} == {"features"}
