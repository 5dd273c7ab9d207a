"""The atlas (python -m tracing atlas) on the demo over its held-out sample: every table checked
against the same corpus traced one sequence at a time and counted here by hand; batch 1 and 4,
an interrupted and resumed run, and two data-parallel ranks all give the same atlas; bad input
exits 2 with one line and leaves no atlas behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[3]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from model import TINY  # noqa: E402
from model.moe import RouterRule, select_experts  # noqa: E402
from tracing.analyses.recall import head_recall  # noqa: E402
from tracing.atlas import AtlasError, build_atlas, read_atlas  # noqa: E402
from tracing.atlas.corpus import Corpus, Source  # noqa: E402
from tracing.atlas.counts import RECALL_BINS, check_state, far_pairs, sink_bins  # noqa: E402
from tracing.atlas.tables import COLUMNS, PRIOR, _expert_tokens  # noqa: E402
from tracing.cli.commands import main  # noqa: E402
from tracing.cli.loading import DEMO, open_checkpoint  # noqa: E402
from tracing.errors import InputError  # noqa: E402
from tracing.runner import trace_tokens  # noqa: E402

SAMPLE = DEMO / "heldout_sample.txt"
SEQ_LEN, MAX_TOKENS, MIN_COUNT = 128, 700, 2  # 5 windows of 128 and one of 60: three batches of 4
ARGS = ["--checkpoint", "demo", "--text-file", str(SAMPLE), "--seq-len", str(SEQ_LEN), "--max-tokens", str(MAX_TOKENS)]
ARGS += ["--min-count", str(MIN_COUNT)]
RUN_ONLY = ("seconds", "tokens_per_s", "settings", "resumed_after_batches")  # summary keys that describe the run

pytestmark = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")


@pytest.fixture(scope="module")
def demo():
    return open_checkpoint("demo")


@pytest.fixture(scope="module")
def atlas_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("atlas") / "batch4"
    assert main(["atlas", *ARGS, "--batch-size", "4", "--out", str(out)]) == 0
    return out


def assert_same_atlas(got: Path, want: Path, exact: bool = True) -> None:
    """The same tables and summary; ``exact=False``: floats (gate weights, recall) to 1e-4."""
    a, b = read_atlas(got), read_atlas(want)
    for name in COLUMNS:
        pd.testing.assert_frame_equal(a.tables[name], b.tables[name], check_exact=exact, rtol=1e-4, atol=1e-4, obj=name)
    assert {k: v for k, v in a.summary.items() if k not in RUN_ONLY} == {k: v for k, v in b.summary.items() if k not in RUN_ONLY}


# -------------------------------------------------------------------------------------------------
# every table against the corpus traced one sequence at a time


def traced(model, tokenizer) -> list[dict[str, torch.Tensor]]:
    corpus = Corpus([Source(SAMPLE)], tokenizer, SEQ_LEN, 1, MAX_TOKENS)
    sites = ["layers.*.ffn.gate.scores", "layers.*.ffn.gate.groups", "layers.*.ffn.gate.topk_*"]
    sites += ["layers.*.attn.indexer.topk_indices", "layers.*.attn.indexer.recall"]
    return [trace_tokens(model, batch[0], record=sites).tensors for batch in corpus.batches()]


def check_sinks(table: pd.DataFrame, state: dict, block: int, traces: list[dict], first: int) -> None:
    """Picks from afar (query - key >= index_topk) and the pairs that could make them, counted
    pair by pair, by key position and by token; expected at the block's rate per distance bin."""
    lo, hi = sink_bins(SEQ_LEN)
    n_bins, vocab = len(lo), state["token_count"].numel()
    bin_of = np.searchsorted(hi, np.arange(SEQ_LEN))  # distance -> its bin
    picks_pos, picks_tok = np.zeros(SEQ_LEN, np.int64), np.zeros(vocab, np.int64)
    pairs_pos, pairs_tok = np.zeros((SEQ_LEN, n_bins), np.int64), np.zeros((vocab, n_bins), np.int64)
    picks_bin = np.zeros(n_bins, np.int64)
    for tr in traces:
        ids, chosen = tr["tokens"].numpy(), tr[f"layers.{block}.attn.indexer.topk_indices"].numpy()
        for q in range(first, len(ids)):
            for p in range(q - first + 1):
                pairs_pos[p, bin_of[q - p]] += 1
                pairs_tok[ids[p], bin_of[q - p]] += 1
            for p in chosen[q][chosen[q] <= q - first]:
                picks_pos[p] += 1
                picks_tok[ids[p]] += 1
                picks_bin[bin_of[q - p]] += 1
    assert np.array_equal(state["sink_position_selected"][block].numpy(), picks_pos)
    assert np.array_equal(state["sink_token_selected"][block].numpy(), picks_tok)
    assert np.array_equal(state["sink_token_visible"].numpy(), pairs_tok)
    assert np.array_equal(far_pairs(state["length_count"].numpy(), first), pairs_pos)
    rate = picks_bin / np.maximum(pairs_pos.sum(0), 1)
    assert (pairs_pos @ rate).sum() == pytest.approx(picks_pos.sum()) and (pairs_tok @ rate).sum() == pytest.approx(
        picks_tok.sum()
    )
    rows = table[table["block"] == block]
    for kind, picks, pairs in (("position", picks_pos, pairs_pos), ("token_id", picks_tok, pairs_tok)):
        mine = rows[rows[kind] >= 0]
        keys = mine[kind].to_numpy()
        assert len(mine) == 20 and (rows[["position", "token_id"]].min(axis=1) == -1).all()
        assert np.array_equal(mine["selected"], picks[keys]) and np.array_equal(mine["visible"], pairs[keys].sum(1))
        np.testing.assert_allclose(mine["expected"], pairs[keys] @ rate)
        np.testing.assert_allclose(mine["lift"], picks[keys] / (pairs[keys] @ rate))
        assert (mine["lift"].diff().dropna() <= 0).all() and (mine["visible"] >= MIN_COUNT).all()
        candidates = picks / np.where(pairs @ rate > 0, pairs @ rate, np.nan)
        candidates[pairs.sum(1) < MIN_COUNT] = np.nan
        if kind == "token_id":  # and tokens seen at least --min-count times
            candidates[state["token_count"].numpy() < MIN_COUNT] = np.nan
        assert mine["lift"].iloc[0] == pytest.approx(np.nanmax(candidates))  # none left out above the top
    bos = rows[(rows["position"] == 0)].iloc[0]
    assert bos["lift"] == rows[rows["position"] >= 0]["lift"].max()  # the demo's sink: BOS at position 0


def test_every_table_agrees_with_the_traced_sequences(atlas_dir, demo):
    atlas = read_atlas(atlas_dir)
    state = load_file(str(atlas_dir / "atlas_state.safetensors"))
    args, t = demo.model.args, atlas.tables
    traces = traced(demo.model, demo.tokenizer)
    tokens = sum(len(tr["tokens"]) for tr in traces)
    k, e, first = args.n_activated_experts, args.n_routed_experts, args.index_topk
    assert atlas.summary["tokens"] == tokens == MAX_TOKENS and atlas.summary["sequences"] == len(traces) == 6
    occurrences = np.bincount(np.concatenate([tr["tokens"].numpy() for tr in traces]), minlength=args.vocab_size)
    rule = RouterRule.of(args)
    for block in range(args.n_dense_layers, args.n_layers):
        chosen = torch.cat([tr[f"layers.{block}.ffn.gate.topk_indices"] for tr in traces])  # (tokens, k)
        load = t["expert_load"][t["expert_load"]["block"] == block]
        assert load["count"].tolist() == np.bincount(chosen.flatten(), minlength=e).tolist()
        assert load["count"].sum() == tokens * k and np.isclose(load["share"].sum(), 1.0)
        weights = torch.cat([tr[f"layers.{block}.ffn.gate.topk_weights"] for tr in traces]).double()
        per_expert = torch.zeros(e, dtype=torch.float64).index_add_(0, chosen.flatten(), weights.flatten())
        np.testing.assert_allclose(load["weight_sum"], per_expert, atol=k * tokens * 2**-25)
        pairs = t["expert_pairs"][t["expert_pairs"]["block"] == block]
        want = pd.Series([p for row in chosen.tolist() for p in combinations(sorted(row), 2)]).value_counts()
        got = {(a, b): c for a, b, c in pairs[["expert_a", "expert_b", "count"]].itertuples(index=False)}
        assert got == dict(want) and pairs["count"].sum() == tokens * k * (k - 1) // 2  # a chosen pair once per token
        groups = torch.cat([tr[f"layers.{block}.ffn.gate.groups"] for tr in traces])
        group = t["group_load"][t["group_load"]["block"] == block]
        assert group["count"].tolist() == np.bincount(groups.flatten(), minlength=args.n_expert_groups).tolist()
        unbiased = torch.cat([select_experts(tr[f"layers.{block}.ffn.gate.scores"], None, rule).topk_indices for tr in traces])
        changed = ~(chosen[:, :, None] == unbiased[:, None, :]).any(-1)
        bias = t["bias_effect"][t["bias_effect"]["block"] == block].iloc[0]
        assert (bias["tokens"], bias["tokens_changed"], bias["selections_changed"]) == (
            tokens,
            changed.any(1).sum(),
            changed.sum(),
        )
        assert 0 < bias["tokens_changed"] < tokens  # the demo's trained bias moves some choices, not all
        specific = t["expert_tokens"][t["expert_tokens"]["block"] == block]
        ids = torch.cat([tr["tokens"] for tr in traces])
        pair_counts = pd.Series(list(zip(chosen.flatten().tolist(), ids.repeat_interleave(k).tolist(), strict=True)))
        pair_counts = pair_counts.value_counts()
        for expert, rows in specific.groupby("expert"):
            mine = {tok: c for (ex, tok), c in pair_counts.items() if ex == expert and c >= MIN_COUNT}
            rate = load["count"].iloc[expert] / tokens
            pmi = {tok: np.log2(c / (rate * occurrences[tok])) for tok, c in mine.items()}
            spec = {tok: np.log2((c + PRIOR * rate) / ((occurrences[tok] + PRIOR) * rate)) for tok, c in mine.items()}
            best = sorted(spec.values(), reverse=True)[:20]
            np.testing.assert_allclose(rows["specificity"], best)  # the most specific, best first
            np.testing.assert_allclose(rows["pmi"], [pmi[tok] for tok in rows["token_id"]])
            assert rows["count"].tolist() == [mine[tok] for tok in rows["token_id"]]
            assert rows["token"].tolist() == demo.tokenizer.token_strings(rows["token_id"].tolist())
    for block in range(args.n_layers):
        keys = [tr[f"layers.{block}.attn.indexer.topk_indices"][first:] for tr in traces]  # (T - K, K): pruning queries
        distance = np.concatenate([(np.arange(first, first + len(x))[:, None] - x.numpy()).ravel() for x in keys])
        bins = np.where(distance == 0, -1, np.floor(np.log2(np.maximum(distance, 1))).astype(int))
        dist = t["indexer_distance"][t["indexer_distance"]["block"] == block]
        assert dict(zip(dist["distance_bin"], dist["count"], strict=True)) == {
            b: int((bins == b).sum()) for b in range(-1, int(np.log2(SEQ_LEN - 1)) + 1)
        }
        recall = np.concatenate([tr[f"layers.{block}.attn.indexer.recall"][first:].numpy() for tr in traces])
        row = t["indexer_recall"][t["indexer_recall"]["block"] == block].iloc[0]
        assert row["queries"] == len(recall) == sum(len(x) for x in keys)
        assert row["mean"] == pytest.approx(recall.mean(), abs=1e-6)
        for name, p in (("p10", 0.1), ("p50", 0.5), ("p90", 0.9)):  # the bin's midpoint: within half a bin
            assert row[name] == pytest.approx(np.quantile(recall, p, method="inverted_cdf"), abs=0.5 / RECALL_BINS + 1e-6)
        check_sinks(t["indexer_sinks"], state, block, traces, first)
    imbalance = atlas.summary["imbalance"]
    assert sorted(imbalance) == ["1", "2", "3"]
    for block, figures in imbalance.items():
        counts = t["expert_load"][t["expert_load"]["block"] == int(block)]["count"].to_numpy()
        assert figures["max_over_mean"] == pytest.approx(counts.max() / counts.mean())
        assert figures["cv"] == pytest.approx(counts.std() / counts.mean()) and figures["never_chosen"] == (counts == 0).sum()
    assert atlas.summary["texts"][0]["sha256"] == __import__("hashlib").sha256(SAMPLE.read_bytes()).hexdigest()


def test_the_block_measures_are_the_traced_overlaps_and_near_ties(atlas_dir, demo):
    """Per block the mean of ``attn.indexer.overlap_prev`` over the queries that see more than
    index_topk keys, and per MoE block the share of routings whose ``ffn.gate.margin`` and
    ``ffn.gate.group_margin`` fall below 1e-3, as the traced sequences give them one by one."""
    args, first = demo.model.args, demo.model.args.index_topk
    corpus = Corpus([Source(SAMPLE)], demo.tokenizer, SEQ_LEN, 1, MAX_TOKENS)
    sites = "layers.*.attn.indexer.overlap_prev,layers.*.ffn.gate.margin,layers.*.ffn.gate.group_margin"
    traces = [trace_tokens(demo.model, batch[0], record=sites).tensors for batch in corpus.batches()]
    table = read_atlas(atlas_dir).tables["block_measures"].set_index("block")
    assert list(table.index) == list(range(args.n_layers)) and list(table.columns) == list(COLUMNS["block_measures"][1:])
    assert table.loc[0, "overlap_queries"] == 0 and np.isnan(table.loc[0, "overlap_prev"])
    for block in range(1, args.n_layers):
        overlap = np.concatenate([tr[f"layers.{block}.attn.indexer.overlap_prev"][first:].numpy() for tr in traces])
        assert table.loc[block, "overlap_queries"] == len(overlap) > 0
        assert table.loc[block, "overlap_prev"] == pytest.approx(overlap.mean(), abs=1e-6) and 0 < overlap.mean() < 1
    assert table.loc[0, "routings"] == 0 and np.isnan(table.loc[0, "near_tie_share"])  # the demo's dense block
    for block in range(args.n_dense_layers, args.n_layers):
        for column, site in (("near_tie", "margin"), ("group_near_tie", "group_margin")):
            margins = np.concatenate([tr[f"layers.{block}.ffn.gate.{site}"].numpy() for tr in traces])
            ties = int((margins < 1e-3).sum())
            assert table.loc[block, f"{column}s"] == ties and table.loc[block, "routings"] == len(margins) == MAX_TOKENS
            assert table.loc[block, f"{column}_share"] == pytest.approx(ties / MAX_TOKENS)
    assert table["near_ties"].sum() > 0  # the demo's routings come near a tie now and then
    state = load_file(str(atlas_dir / "atlas_state.safetensors"))
    older = {name: value for name, value in state.items() if name not in ("overlap_sum", "overlap_queries")}
    with pytest.raises(InputError, match="holds no overlap_sum .written before the atlas counted it"):
        check_state(older, args, SEQ_LEN, "old.safetensors")  # a checkpoint of an atlas without these counts


def test_recall_is_the_dense_mass_on_the_selected_keys():
    """tracing.analyses.recall against the mask it stands for: -1 selects nothing, a key listed twice counts
    once, a key after its query not at all; the indexer's own (distinct) selections skip the sort."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 5, 3, 9, generator=g).bfloat16()  # the last 5 queries of 9 positions
    selected = torch.randint(-1, 9, (2, 5, 4), generator=g)
    selected[0, 0] = torch.tensor([4, 4, -1, 8])  # a duplicate, none, and a key after query 4
    dense = scores.float().masked_fill(~torch.ones(5, 9, dtype=torch.bool).tril(4)[:, None, :], float("-inf")).softmax(-1)
    keep = torch.zeros(2, 5, 10, dtype=torch.bool).scatter_(-1, selected.where(selected >= 0, 9), True)[..., :9]
    want = (dense * keep[:, :, None, :]).sum(-1)
    torch.testing.assert_close(head_recall(scores, selected), want, rtol=0, atol=1e-6)
    distinct = torch.stack([torch.stack([torch.randperm(9, generator=g)[:4] for _ in range(5)]) for _ in range(2)])
    unsorted = head_recall(scores, distinct, distinct=True)  # the same terms, added in another order
    torch.testing.assert_close(unsorted, head_recall(scores, distinct), rtol=0, atol=1e-6)


# -------------------------------------------------------------------------------------------------
# batches, resumption, ranks: the same atlas


def test_batch_1_streamed_gives_the_atlas_of_batch_4(atlas_dir, tmp_path):
    """One sequence per forward, the weights streamed block by block: the same counts, bit for bit."""
    assert main(["atlas", *ARGS, "--batch-size", "1", "--stream", "--out", str(tmp_path / "batch1")]) == 0
    assert read_atlas(tmp_path / "batch1").summary["settings"]["stream"] is True
    assert_same_atlas(tmp_path / "batch1", atlas_dir)


def test_jsonl_records_are_texts(atlas_dir, tmp_path):
    """The sample as one JSONL record, after an empty one and a blank line: the same sequences, the same atlas."""
    corpus = tmp_path / "corpus.jsonl"
    records = [{"body": "", "id": 1}, {"body": SAMPLE.read_text(encoding="utf-8"), "id": 2}]
    corpus.write_text(json.dumps(records[0]) + "\n\n" + json.dumps(records[1]) + "\n", encoding="utf-8")
    argv = ["--checkpoint", "demo", "--jsonl", str(corpus), "--field", "body", *ARGS[4:]]
    assert main(["atlas", *argv, "--out", str(tmp_path / "jsonl")]) == 0
    atlas = read_atlas(tmp_path / "jsonl")
    assert atlas.summary["texts"] == [
        {"path": str(corpus), "sha256": __import__("hashlib").sha256(corpus.read_bytes()).hexdigest(), "texts": 1}
        | {"tokens": MAX_TOKENS, "field": "body", "empty_records": 1}
    ]
    for name in COLUMNS:
        pd.testing.assert_frame_equal(atlas.tables[name], read_atlas(atlas_dir).tables[name], check_exact=True, obj=name)


def test_an_interrupted_run_resumes_without_counting_twice(atlas_dir, demo, tmp_path):
    out = tmp_path / "resumed"
    settings = {"seq_len": SEQ_LEN, "max_tokens": MAX_TOKENS, "min_count": MIN_COUNT, "batch_size": 4, "checkpoint_every": 0}

    def interrupt(done: int) -> None:
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_atlas(demo, [Source(SAMPLE)], out, on_round=interrupt, **settings)
    assert sorted(p.name for p in out.iterdir()) == ["atlas_state.safetensors"]  # the checkpoint, no atlas
    with pytest.raises(AtlasError, match="summary.json"):
        read_atlas(out)
    summary = build_atlas(demo, [Source(SAMPLE)], out, resume=True, **settings)
    assert summary["resumed_after_batches"] == 2
    assert_same_atlas(out, atlas_dir)
    # resuming a finished run runs nothing and writes the same atlas
    again = build_atlas(demo, [Source(SAMPLE)], out, resume=True, **settings)
    assert again["resumed_after_batches"] == again["settings"]["batches"] == 3
    assert_same_atlas(out, atlas_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_give_the_atlas_of_one_process(atlas_dir, tmp_path):
    """Two CPU ranks as torchrun starts them: data parallel through the command line, and the model
    split over the ranks (expert parallel on the demo) through the API."""
    port, procs = _free_port(), []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, __file__, str(tmp_path)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    data = read_atlas(tmp_path / "data")
    assert data.summary["settings"]["parallel"] == "data" and data.summary["settings"]["world_size"] == 2
    assert_same_atlas(tmp_path / "data", atlas_dir)
    assert read_atlas(tmp_path / "model").summary["settings"]["parallel"] == "model"
    # the same selections; a model split over ranks may differ from one process in the last bits of its float
    # values (tests/test_parallel.py), and so may the gate weights and recall counted from them
    assert_same_atlas(tmp_path / "model", atlas_dir, exact=False)


@pytest.mark.slow  # four processes on two cores (15-20 s); its two halves are the two-rank test's
def test_four_ranks_split_the_model_in_two_and_share_the_batches_between_the_halves(atlas_dir, tmp_path):
    """The 2-D layout of several nodes, on 4 CPU ranks: the model split over each pair of ranks (a
    node's GPUs), the batches shared between the pairs (the nodes): the atlas of one process."""
    port = _free_port()
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-addr", "127.0.0.1"]
    atlas = ["-m", "tracing", "atlas", *ARGS, "--batch-size", "2", "--parallel", "model", "--model-ranks", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    done = subprocess.run(
        [*launch, "--master-port", str(port), *atlas, "--out", str(tmp_path / "2d")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = read_atlas(tmp_path / "2d")
    assert got.summary["settings"]["parallel"] == "model x data (2 x 2)" and got.summary["settings"]["world_size"] == 4
    assert_same_atlas(tmp_path / "2d", atlas_dir, exact=False)


def worker(out: Path) -> None:
    from tracing.atlas.corpus import Source as Src

    loaded = open_checkpoint("demo", split=True)  # joins the process group; the experts split over the ranks
    settings = {"seq_len": SEQ_LEN, "max_tokens": MAX_TOKENS, "min_count": MIN_COUNT, "batch_size": 4}
    build_atlas(loaded, [Src(SAMPLE)], out / "model", **settings)
    code = main(["atlas", *ARGS, "--batch-size", "2", "--out", str(out / "data")])  # every rank the whole model
    sys.exit(code)


# -------------------------------------------------------------------------------------------------
# bad input


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "empty.txt").write_bytes(b"")
    (tmp / "latin1.txt").write_bytes("café".encode("latin-1"))
    (tmp / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "broken\n', encoding="utf-8")
    (tmp / "nofield.jsonl").write_text('{"body": "no text field"}\n', encoding="utf-8")
    text = ["--checkpoint", "demo", "--text-file", str(SAMPLE)]
    return {
        "no texts": (["--checkpoint", "demo"], "no texts"),
        "empty file": (["--checkpoint", "demo", "--text-file", str(tmp / "empty.txt")], "empty"),
        "missing file": (["--checkpoint", "demo", "--text-file", str(tmp / "absent.txt")], "cannot read"),
        "not utf-8": (["--checkpoint", "demo", "--text-file", str(tmp / "latin1.txt")], "not UTF-8"),
        "seq-len 1": ([*text, "--seq-len", "1"], "at least 2"),
        "seq-len too long": ([*text, "--seq-len", "257"], "at most 256"),
        "unreadable JSONL line": (["--checkpoint", "demo", "--jsonl", str(tmp / "bad.jsonl")], "line 2: not valid JSON"),
        "no such field": (["--checkpoint", "demo", "--jsonl", str(tmp / "nofield.jsonl")], "no field 'text'"),
        "batch size 0": ([*text, "--batch-size", "0"], "--batch-size"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "no texts",
        "empty file",
        "missing file",
        "not utf-8",
        "seq-len 1",
        "seq-len too long",
        "unreadable JSONL line",
        "no such field",
        "batch size 0",
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_atlas(capsys, tmp_path, case):
    argv, says = _bad_inputs(tmp_path)[case]
    out = tmp_path / "out"
    code = main(["atlas", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err and "Traceback" not in err, err
    assert not out.exists()


def test_resume_refuses_the_checkpoint_of_another_run(capsys, atlas_dir, tmp_path):
    out = tmp_path / "other"
    out.mkdir()
    (out / "atlas_state.safetensors").write_bytes((atlas_dir / "atlas_state.safetensors").read_bytes())
    code = main(["atlas", *ARGS[:-4], "--seq-len", "64", "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "seq_len 128 there, 64 here" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["atlas_state.safetensors"]


def test_read_atlas_names_what_is_wrong(atlas_dir, tmp_path):
    with pytest.raises(AtlasError, match="not a directory"):
        read_atlas(tmp_path / "absent")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in atlas_dir.iterdir():
        if f.name != "expert_pairs.parquet":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(AtlasError, match="expert_pairs.parquet is missing"):
        read_atlas(broken)
    (broken / "expert_pairs.parquet").write_bytes(b"not parquet")
    with pytest.raises(AtlasError, match="not a readable Parquet table"):
        read_atlas(broken)
    summary = json.loads((atlas_dir / "summary.json").read_text())
    assert summary["tables"] == {name: list(cols) for name, cols in COLUMNS.items()}


if __name__ == "__main__":
    worker(Path(sys.argv[1]))


def test_specificity_orders_tokens_of_equal_exclusivity_by_their_count():
    """Three tokens that always choose expert 0 (PMI ties at log2 1/P(e)) and one that chooses it half
    the time: the specificity ranks the exclusive ones by their count, the most seen first."""
    args = TINY.replace(vocab_size=8)  # the table reads the vocabulary and the experts' count only
    counts = {1: 40, 2: 10, 3: 5, 4: 20}  # token -> times it chose expert 0
    occurrences = np.zeros(8, dtype=np.int64)
    occurrences[[1, 2, 3, 4]] = [40, 10, 5, 40]
    s = {
        "expert_token_keys": np.array(list(counts)),  # block slot 0, expert 0: key = token
        "expert_token_counts": np.array(list(counts.values())),
        "tokens": np.array([400]),
        "expert_count": np.array([[75] + [100] * (TINY.n_routed_experts - 1)]),
        "token_count": occurrences,
    }
    frame = _expert_tokens(s, [1], args, lambda ids: [f"t{i}" for i in ids], min_count=1)
    assert frame["token_id"].tolist() == [1, 2, 3, 4]
    exclusive = frame[frame["token_id"] != 4]
    assert exclusive["pmi"].nunique() == 1 and exclusive["specificity"].is_monotonic_decreasing
    assert (frame["specificity"] < frame["pmi"]).all()  # the prior pulls every score toward 0


def test_an_atlas_under_an_intervention_counts_what_the_model_used(tmp_path, capsys, atlas_dir):
    out = tmp_path / "ablated"
    assert main(["atlas", *ARGS, "--batch-size", "4", "--ablate-experts", "1:0,1:3", "--out", str(out)]) == 0
    ablated, plain = read_atlas(out), read_atlas(atlas_dir)
    load = ablated.tables["expert_load"].query("block == 1 and expert in (0, 3)")
    assert (load["count"] == 0).all() and (
        plain.tables["expert_load"].query("block == 1 and expert in (0, 3)")["count"] > 0
    ).any()
    assert ablated.summary["settings"]["interventions"] == ["ablate 1:0, 1:3"]
    assert ablated.summary["tokens"] == plain.summary["tokens"]
    capsys.readouterr()
    assert main(["atlas", *ARGS, "--batch-size", "4", "--no-gate-bias", "--resume", "--out", str(out)]) == 2
    assert "interventions" in capsys.readouterr().err  # another intervention is another run: not resumed
    assert main(["atlas", *ARGS, "--zero-experts", "1:0@3", "--out", str(tmp_path / "x")]) == 2
    assert "applies to run" in capsys.readouterr().err
