"""Feature pages over a corpus: the batched totals are what traces of each sequence (whose features
are the dictionary applied by hand, test_features.py) give, counted by hand."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from model import TINY
from model.checkpoint import SafetensorsSource
from tracing.cli.commands import main
from tracing.cli.loading import Loaded, resolve_checkpoint
from tracing.dictionary import save
from tracing.dictionary.pages import PageSettings, feature_pages
from tracing.runner import TraceRequest, run
from tracing.sites import FEATURES_TOPK
from tracing.tables.files import PAGE_TABLES

from .test_features import dictionary


def test_page_tables_are_the_traces_counted_by_hand(tiny_model):
    d = dictionary(site="layers.1.resid_post", n=24, k=3)  # read by block 2's router and indexer next
    ids = torch.randint(0, TINY.vocab_size, (4, 20), generator=torch.Generator().manual_seed(5)).tolist()
    batches = [ids[:2], ids[2:]]
    loaded = Loaded(tiny_model, None, None, "tiny", torch.device("cpu"))
    tables = feature_pages(loaded, {"resid": d}, batches, PageSettings(contexts=3, window=2, logit_tokens=4, experts=16))
    summary = tables["feature_summary"].set_index("feature")
    assert (summary["moe_block"] == 2).all() and (summary["indexer_block"] == 2).all()

    record = ("layers.2.ffn.gate.topk_indices", "layers.2.attn.indexer.topk_indices")
    traces = [run(tiny_model, TraceRequest(token_ids=tuple(seq), record=record, dictionaries=(d,))) for seq in ids]
    fid = torch.cat([t["layers.1.resid_post.features.top_ids"] for t in traces])  # (N, F)
    acts = torch.cat([t["layers.1.resid_post.features.top_acts"] for t in traces])
    experts = torch.cat([t["layers.2.ffn.gate.topk_indices"] for t in traces])  # (N, k)
    active = torch.bincount(fid[fid >= 0], minlength=d.n_features)
    assert summary["active_positions"].tolist() == active.tolist()
    best = torch.zeros(d.n_features).scatter_reduce(0, fid[fid >= 0], acts[fid >= 0], "amax")
    torch.testing.assert_close(torch.tensor(summary["max_activation"].to_numpy(copy=True), dtype=torch.float32), best)

    f = int(active.argmax())  # the busiest feature: its routing against the block's base rates
    rows = (fid == f).any(1)
    by_hand = torch.bincount(experts[rows].reshape(-1), minlength=TINY.n_routed_experts)
    routed = tables["feature_experts"].query("feature == @f").set_index("expert")
    assert routed["positions"].to_dict() == {e: int(c) for e, c in enumerate(by_hand) if c}
    base = torch.bincount(experts.reshape(-1), minlength=TINY.n_routed_experts) / experts.numel()
    torch.testing.assert_close(
        torch.tensor(routed["base_share"].to_numpy(copy=True)), base[routed.index.to_numpy(copy=True)].double()
    )
    e = int(by_hand.argmax())  # the features that expert's positions carry most, by activation mass
    mass = torch.zeros(d.n_features, dtype=torch.float64)
    for row in (experts == e).any(1).nonzero()[:, 0]:
        kept = fid[row] >= 0
        mass.index_add_(0, fid[row][kept], acts[row][kept].double())
    carried = tables["expert_features"].query("expert == @e").sort_values("rank")
    assert carried["feature"].tolist() == mass.topk(min(10, int((mass > 0).sum()))).indices.tolist()
    torch.testing.assert_close(
        torch.tensor(carried["activation_mass"].to_numpy(copy=True)), mass[carried["feature"].to_numpy(copy=True)]
    )

    contexts = tables["feature_contexts"].query("feature == @f").sort_values("rank")
    strongest = acts[fid == f].sort(descending=True).values[:3]
    torch.testing.assert_close(torch.tensor(contexts["activation"].to_numpy(copy=True), dtype=torch.float32), strongest)
    top = contexts.iloc[0]
    seq, pos = int(top["sequence"]), int(top["position"])
    assert f in traces[seq]["layers.1.resid_post.features.top_ids"][pos].tolist()
    assert top["context"].count("[[") == 1 and top["token"] == f"<{ids[seq][pos]}>"
    keys = traces[seq]["layers.2.attn.indexer.topk_indices"]  # (T, K): later queries with index_topk nearer keys
    later = range(pos + TINY.index_topk, len(ids[seq]))
    want = sum(pos in keys[q].tolist() for q in later) / len(later) if len(later) else float("nan")
    assert abs(top["indexer_kept_share"] - want) < 1e-6 or (
        want != want and top["indexer_kept_share"] != top["indexer_kept_share"]
    )

    logits = tables["feature_logits"].query("feature == @f and effect == 'promoted'")
    direction = d.W_dec[f].detach() * tiny_model.norm.weight.float()
    want = tiny_model.head(direction[None]).float()[0].topk(4)
    assert logits["token_id"].tolist() == want.indices.tolist()
    assert len(tables["feature_logits"]) == d.n_features * 2 * 4 and FEATURES_TOPK >= d.k


def _pages_command(app_checkpoint, directory, out, *more) -> list[str]:
    text = Path(__file__).resolve().parents[3] / "assets" / "demo" / "heldout_sample.txt"
    return [
        *("dictionary", "features", "--checkpoint", app_checkpoint, "--dictionary", str(directory)),
        *("--text-file", str(text), "--out", str(out), *more),
    ]


def test_the_pages_command_refuses_a_dictionary_of_another_width_before_loading(app_checkpoint, tmp_path, capsys):
    save(dictionary(width=TINY.dim + 8), tmp_path / "wide")
    code = main(_pages_command(app_checkpoint, tmp_path / "wide", tmp_path / "out"))
    err = capsys.readouterr().err.strip()
    assert code == 2 and "wide, but the model's stream is" in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_pages_command_writes_every_table(app_checkpoint, tmp_path, capsys):
    dim = SafetensorsSource(resolve_checkpoint(app_checkpoint)).args.dim
    save(dictionary(width=dim, n=32, k=4), tmp_path / "resid")
    code = main(
        _pages_command(
            app_checkpoint, tmp_path / "resid", tmp_path / "out", "--max-tokens", "128", "--seq-len", "64", "--parquet"
        )
    )
    assert code == 0, capsys.readouterr().err
    for name in PAGE_TABLES:
        frame = pd.read_csv(tmp_path / "out" / f"{name}.csv")
        assert len(frame) and set(frame["dictionary"]) == {"resid"}, name
        assert pd.read_parquet(tmp_path / "out" / f"{name}.parquet").shape == frame.shape, name
