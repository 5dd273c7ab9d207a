"""The sinks table: per block, the keys the indexer kept from afar in one prompt (queries at least
index_topk later), counted as the atlas's indexer_sinks counts them over a corpus."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from model import TINY
from tracing.cli import main
from tracing.runner import trace_tokens
from tracing.tables.frames import sinks_table
from tracing.trace import Trace

IDS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9, 33, 2]  # T=16 > index_topk=8


def recount(keys: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """kept and queries per key position, query by query, from a block's topk_indices (T, K)."""
    n = len(keys)
    kept, queries = np.zeros(n, np.int64), np.zeros(n, np.int64)
    for q in range(k, n):
        for p in range(q - k + 1):  # the keys at least index_topk before the query
            queries[p] += 1
            kept[p] += p in keys[q]
    return kept, queries


def test_the_sinks_table_equals_a_recount_from_the_selected_keys(tiny_model):
    n, k = len(IDS), TINY.index_topk
    keys = torch.full((n, k), -1, dtype=torch.int64)  # block 1: every query keeps key 0 and its k - 1 nearest
    for q in range(n):
        near = list(range(max(1, q - k + 2), q + 1)) if q >= k else list(range(q + 1))
        keys[q, : len({0, *near})] = torch.tensor(sorted({0, *near}))
    trace = trace_tokens(tiny_model, IDS, patches={"layers.1.attn.indexer.topk_indices": keys})
    frame = trace.tables()["sinks"]
    assert list(frame.columns) == ["block", "position", "token", "kept", "queries", "share"]
    for block in range(TINY.n_layers):
        kept, queries = recount(trace.site(block, "attn.indexer.topk_indices").numpy(), k)
        mine = frame[frame["block"] == block]
        assert sorted(mine["position"]) == list(range(n - k))
        assert mine["kept"].tolist() == kept[mine["position"]].tolist()
        assert mine["queries"].tolist() == queries[mine["position"]].tolist()
        np.testing.assert_allclose(mine["share"], kept[mine["position"]] / queries[mine["position"]])
        assert (mine["share"].diff().dropna() <= 0).all()  # the most kept first
        assert mine["token"].tolist() == [trace.tokens[p] for p in mine["position"]]
    forced = frame[frame["block"] == 1].iloc[0]
    assert (forced["position"], forced["share"]) == (0, 1.0)  # the key every far query kept
    assert (frame[(frame["block"] == 1) & (frame["position"] > 0)]["kept"] == 0).all()


def test_no_sinks_without_a_query_from_afar_or_a_recorded_selection(tiny_model):
    assert sinks_table(trace_tokens(tiny_model, IDS[: TINY.index_topk])).empty  # every query keeps all its keys
    assert "sinks" not in trace_tokens(tiny_model, IDS, record="layers.*.resid_post").tables()


def test_run_csv_writes_the_sinks_table(tiny_checkpoint, tmp_path):
    out = tmp_path / "t.safetensors"
    ids = ",".join(map(str, IDS))
    assert (
        main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--out", str(out), "--csv", str(tmp_path / "csv")])
        == 0
    )
    written = pd.read_csv(tmp_path / "csv" / "sinks.csv", keep_default_na=False)
    want = Trace.load(out).tables()["sinks"]
    assert written[["block", "position", "kept", "queries"]].equals(want[["block", "position", "kept", "queries"]])
    np.testing.assert_allclose(written["share"], want["share"])
