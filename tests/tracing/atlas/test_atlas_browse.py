"""Browsing an atlas: the experts table over every block, its search, and the token search
(token_experts), each checked against the atlas's own totals (atlas_state.safetensors) recounted here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from tracing.atlas import read_atlas
from tracing.atlas.tables import TOP_EXPERTS, experts_table, find_token, search_experts, specificity, token_routes
from tracing.cli.commands import main
from tracing.cli.loading import DEMO

SAMPLE = DEMO / "heldout_sample.txt"
MIN_COUNT = 2
ARGS = ["--checkpoint", "demo", "--text-file", str(SAMPLE), "--seq-len", "128", "--max-tokens", "400"]
ARGS += ["--batch-size", "4", "--min-count", str(MIN_COUNT)]

pytestmark = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("atlas") / "out"
    assert main(["atlas", *ARGS, "--out", str(out)]) == 0
    return out, {k: v.numpy() for k, v in load_file(str(out / "atlas_state.safetensors")).items()}


def recount(state: dict, summary: dict) -> dict[tuple[int, int], dict[int, int]]:
    """(block, token) -> {expert: times the token chose it}, from the totals' expert-token keys."""
    e, v = summary["n_routed_experts"], summary["config"]["vocab_size"]
    out: dict[tuple[int, int], dict[int, int]] = {}
    for key, count in zip(state["expert_token_keys"].tolist(), state["expert_token_counts"].tolist(), strict=True):
        slot, token = divmod(key, v)
        m, expert = divmod(slot, e)
        out.setdefault((summary["moe_blocks"][m], token), {})[expert] = count
    return out


def test_the_experts_table_lists_every_expert_with_its_most_specific_tokens(built):
    atlas = read_atlas(built[0])
    table = experts_table(atlas.tables)
    load = atlas.tables["expert_load"]
    assert len(table) == len(load) == len(atlas.summary["moe_blocks"]) * atlas.summary["n_routed_experts"]
    assert list(zip(table["block"], table["expert"], strict=True)) == sorted(zip(load["block"], load["expert"], strict=True))
    merged = table.merge(load, on=["block", "expert"], suffixes=("", "_load"))
    assert (merged["count"] == merged["count_load"]).all()
    np.testing.assert_allclose(merged["mean_weight"], merged["weight_sum"] / merged["count"])
    specific = atlas.tables["expert_tokens"]
    for row in table.itertuples():
        mine = specific[(specific["block"] == row.block) & (specific["expert"] == row.expert)]
        best = mine.sort_values(["specificity", "count", "token_id"], ascending=[False, False, True]).head(5)
        assert row.top_token_ids == best["token_id"].tolist() and row.top_tokens == best["token"].tolist()
    assert table["top_tokens"].map(len).max() == 5


def test_the_search_matches_block_expert_numbers_and_token_substrings(built):
    table = experts_table(read_atlas(built[0]).tables)
    assert len(search_experts(table, "  ")) == len(table)
    three = search_experts(table, "3")
    by_number = (table["block"] == 3) | (table["expert"] == 3)
    by_token = table["top_tokens"].map(lambda ts: any("3" in t for t in ts))
    assert three.index.tolist() == table.index[by_number | by_token].tolist() and by_number.sum() > 1
    word = next(t for ts in table["top_tokens"] for t in ts if t.strip().isalpha() and len(t.strip()) > 3).strip()
    found = search_experts(table, word[1:].upper())  # a substring, in another case
    assert len(found) > 0 and all(any(word[1:].lower() in t.lower() for t in ts) for ts in found["top_tokens"])
    assert search_experts(table, "no token holds this").empty


def test_token_search_equals_a_recount_from_the_totals(built):
    out, state = built
    atlas = read_atlas(out)
    summary, k = atlas.summary, atlas.summary["n_activated_experts"]
    counts = recount(state, summary)
    occurrences = state["token_count"]
    common = int(np.argmax(occurrences))
    for text in (str(common), atlas.tables["token_experts"].query("token_id == @common")["token"].iloc[0]):
        assert find_token(atlas.tables, text) == common
    routes = token_routes(atlas.tables, common)
    assert sorted(routes["block"].unique().tolist()) == summary["moe_blocks"]
    load = atlas.tables["expert_load"].set_index(["block", "expert"])["count"]
    for block, rows in routes.groupby("block"):
        mine = counts[block, common]
        want = sorted(mine.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_EXPERTS]
        assert list(zip(rows["expert"], rows["count"], strict=True)) == want
        assert (rows["occurrences"] == occurrences[common]).all() and sum(mine.values()) == occurrences[common] * k
        np.testing.assert_allclose(rows["share"], rows["count"] / (occurrences[common] * k))
        loads = load.loc[[(block, e) for e in rows["expert"]]].to_numpy()
        np.testing.assert_allclose(rows["specificity"], specificity(rows["count"], occurrences[common], loads, summary["tokens"]))
    rare = int(np.flatnonzero((occurrences > 0) & (occurrences < MIN_COUNT))[0])
    assert find_token(atlas.tables, str(rare)) is None  # seen, but below --min-count
    assert find_token(atlas.tables, "no such token") is None


def test_an_atlas_without_token_experts_still_reads(built, tmp_path):
    out, _ = built
    for f in out.iterdir():
        if f.name != "token_experts.parquet":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    older = read_atlas(tmp_path)
    assert "token_experts" not in older.tables and find_token(older.tables, "1") is None
    assert len(experts_table(older.tables)) == len(older.tables["expert_load"])
