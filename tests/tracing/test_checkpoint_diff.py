"""One prompt on two checkpoints (``tracing diff --checkpoint A --against B``): the trace diff's
tables, per block and per position, from two synthetic checkpoints that share a tokenizer."""

import json
import shutil

import pandas as pd
import pytest
import torch

from model import TINY
from model.checkpoint import save_checkpoint
from model.synthetic import SyntheticSource
from tests.devcheckpoint import SENTENCES, make_dev_checkpoint, train_tokenizer
from tracing.analyses.diff import check_tokenizers, diff_checkpoints, diff_tables, summary, trace_checkpoints
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.runner import TraceRequest
from tracing.trace import Trace

PROMPT = "It is a truth universally acknowledged, that a single man"  # more tokens than TINY's index_topk (8)
BLOCK_COLUMNS = {
    "rel_l2_mean",
    "rel_l2_max",
    "cosine_mean",
    "experts_jaccard",
    "experts_changed_share",
    "keys_jaccard",
    "keys_changed_share",
    "attn_tv",
    "top_key_changed_share",
    "a_on_keys_b",
    "b_on_keys_a",
    "lens_top1_changed_share",
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Two tiny checkpoints of one tokenizer, seeds 1 and 2, and one in DeepSeek-V3's layout (no indexer)."""
    root = tmp_path_factory.mktemp("pair")
    return {
        "one": make_dev_checkpoint(root / "one", seed=1),
        "two": make_dev_checkpoint(root / "two", seed=2),
        "v3": make_dev_checkpoint(root / "v3", seed=1, v3=True),
    }


def refused(capsys, *argv) -> str:
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


def test_two_seeds_differ_block_by_block_and_position_by_position(checkpoints):
    tables = diff_checkpoints(checkpoints["one"], checkpoints["two"], PROMPT, record="default,layers.*.logit_lens.*")
    blocks, logits = tables["blocks"], tables["logits"]
    n_tokens = logits["position"].nunique()
    assert n_tokens > TINY.index_topk and list(blocks["block"]) == list(range(TINY.n_layers))
    assert set(blocks.columns) == {"block"} | BLOCK_COLUMNS
    assert (blocks["rel_l2_mean"] > 0.1).all() and (blocks["cosine_mean"] < 0.9).all()
    dense, moe = blocks.iloc[: TINY.n_dense_layers], blocks.iloc[TINY.n_dense_layers :]
    assert dense["experts_jaccard"].isna().all() and (moe["experts_jaccard"] < 1).all()
    assert (moe["experts_changed_share"] > 0).all() and (blocks["attn_tv"] > 0).all()
    assert (blocks["keys_jaccard"] < 1).any() and blocks["lens_top1_changed_share"].notna().all()
    assert len(logits) == n_tokens and (logits["kl"] > 0).all()
    assert len(tables["attention"]) == len(tables["indexer_keys"]) == TINY.n_layers * n_tokens
    # a share of attention on the other's keys is defined where its indexer drops a key the query sees,
    # the same rows in the table and in the block means, and it is a share: never above 1
    att = tables["attention"]
    for share, dropped in (("a_on_keys_b", "keys_dropped_b"), ("b_on_keys_a", "keys_dropped_a")):
        kept_all = att[dropped] == 0
        assert list(kept_all) == list(att["position"] < TINY.index_topk), share
        assert att.loc[kept_all, share].isna().all() and att.loc[~kept_all, share].between(0, 1).all()
        means = att[~kept_all].groupby("block")[share].mean()
        assert blocks.set_index("block")[share].to_numpy() == pytest.approx(means.to_numpy())


def test_the_same_checkpoint_twice_agrees_everywhere(capsys, checkpoints, tmp_path):
    one = checkpoints["one"]
    out = tmp_path / "traces"
    csv = out / "tables"  # the documented form: the tables inside the new --out-dir
    assert (
        main(
            [
                "diff",
                "--checkpoint",
                str(one),
                "--against",
                str(one),
                "--prompt",
                PROMPT,
                "--out-dir",
                str(out),
                "--csv",
                str(csv),
            ]
        )
        == 0
    )
    info = json.loads(capsys.readouterr().out)
    assert info["first_block_changed"] is None and info["kl_mean"] == 0 and info["top1_agreement"] == 1
    assert info["experts_changed"] == 0 and info["indexer_keys_changed"] == 0 and info["a"] == info["b"] == str(one)
    assert json.loads((out / "summary.json").read_text()) == info
    a, b = Trace.load(out / "a.safetensors"), Trace.load(out / "b.safetensors")
    assert a.token_ids == b.token_ids and "logits.all" in a
    blocks = pd.read_csv(csv / "blocks.csv")
    assert (blocks[["rel_l2_mean", "rel_l2_max", "attn_tv", "keys_changed_share"]] == 0).all().all()
    assert (blocks["cosine_mean"] > 0.999999).all() and (blocks["keys_jaccard"] == 1).all()
    assert (blocks["experts_jaccard"].dropna() == 1).all() and (blocks["experts_changed_share"].dropna() == 0).all()
    assert {"stream.csv", "experts.csv", "attention.csv", "logits.csv"} <= {p.name for p in csv.iterdir()}
    # the traces it wrote diff as it did
    assert main(["diff", str(out / "a.safetensors"), str(out / "b.safetensors")]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again == {k: v for k, v in info.items() if k not in ("a", "b")}


def test_a_v3_layout_against_v32_has_no_indexer_columns_on_its_side(checkpoints):
    a, b = trace_checkpoints(checkpoints["v3"], checkpoints["one"], TraceRequest(prompt=PROMPT))
    assert not a.layers_with("attn.indexer.topk_indices") and b.layers_with("attn.indexer.topk_indices")
    tables = diff_tables(a, b)
    blocks = tables["blocks"]
    assert "indexer_keys" not in tables and blocks["keys_jaccard"].isna().all() and blocks["b_on_keys_a"].isna().all()
    # a's dense attention mass on b's selected keys: a share, below 1 where b's indexer drops keys
    assert ((blocks["a_on_keys_b"] > 0) & (blocks["a_on_keys_b"] < 1)).all()
    assert (blocks["attn_tv"] > 0).all() and (blocks["rel_l2_mean"] > 0).all()  # the same seed, another attention
    assert 0 <= summary(a, b, tables)["top1_agreement"] <= 1


def test_tokenizers_that_differ_are_refused(capsys, checkpoints, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(checkpoints["one"], other)
    train_tokenizer(other, [s[::-1] * 8 for s in SENTENCES], TINY.vocab_size, ["<bos>", "<eos>"])
    err = refused(capsys, "diff", "--checkpoint", checkpoints["one"], "--against", other, "--prompt", PROMPT)
    assert "the checkpoints' tokenizers differ" in err
    with pytest.raises(InputError, match="id 7 reads 'a' in one and 'b' in the other"):
        check_tokenizers([5, 7], [5, 7], 512, 512, ["x", "a"], ["x", "b"])
    with pytest.raises(InputError, match="token 1 of the prompt is id 7 in one and 8 in the other"):
        check_tokenizers([5, 7], [5, 8])


def test_models_of_other_depths_and_wrong_flags_are_refused(capsys, checkpoints, tmp_path):
    args = TINY.replace(n_layers=2, bos_token_id=0, eos_token_id=1)
    source = SyntheticSource(args, seed=1)
    files = {name: checkpoints["one"] / name for name in ("tokenizer.json", "tokenizer_config.json")}
    shallow = save_checkpoint({n: source.load(n) for n in source.specs()}, args, tmp_path / "two-blocks", extra_files=files)
    err = refused(capsys, "diff", "--checkpoint", checkpoints["one"], "--against", shallow, "--prompt", PROMPT)
    assert "different shapes (n_layers 3 and 2)" in err
    one = checkpoints["one"]
    assert "--against" in refused(capsys, "diff", "--checkpoint", one, "--prompt", PROMPT)
    assert "--prompt TEXT or --token-ids" in refused(capsys, "diff", "--checkpoint", one, "--against", one)
    assert "not both" in refused(capsys, "diff", "a.safetensors", "--checkpoint", one, "--against", one, "--prompt", "x")
    assert "--prompt applies to --checkpoint" in refused(capsys, "diff", "a.safetensors", "b.safetensors", "--prompt", "x")
    assert "two trace files" in refused(capsys, "diff", "a.safetensors")
    assert main(["diff", "--checkpoint", str(one), "--against", str(one), "--token-ids", "0,5,9"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 3


def test_one_model_in_memory_at_a_time(checkpoints, monkeypatch):
    """The first model is gone before the second loads: a pair needs the memory of one."""
    import gc

    import tracing.cli.loading as loading
    from model.transformer import Transformer

    alive, load = [], loading.open_checkpoint

    def counted(*args, **kwargs):
        gc.collect()
        alive.append(sum(type(o) is Transformer for o in gc.get_objects()))  # type(): no attribute lookup on the objects
        return load(*args, **kwargs)

    monkeypatch.setattr(loading, "open_checkpoint", counted)
    trace_checkpoints(checkpoints["one"], checkpoints["two"], TraceRequest(prompt=PROMPT))
    assert len(alive) == 2 and alive[1] == alive[0]  # other tests' models may be alive: none of ours


def test_convert_writes_the_v3_layout_copy_of_a_checkpoint(capsys, checkpoints, tmp_path):
    """``convert --layout v3`` of the seed-1 checkpoint is the seed-1 checkpoint made in V3's layout:
    the same tensors less the indexer's, the norm gains in bfloat16, a config of model_type
    deepseek_v3; it refuses a DST that exists and a source already in that layout."""
    from model.checkpoint import SafetensorsSource

    dst = tmp_path / "made" / "v3"
    assert main(["convert", "--layout", "v3", str(checkpoints["one"]), str(dst)]) == 0
    line = json.loads(capsys.readouterr().out)
    made, want = SafetensorsSource(dst), SafetensorsSource(checkpoints["v3"])
    assert line["model_type"] == made.args.model_type == "deepseek_v3" and not made.args.has_indexer
    assert line["dropped"] == len(SafetensorsSource(checkpoints["one"]).weight_map) - len(made.weight_map) > 0
    assert made.args == want.args and set(made.weight_map) == set(want.weight_map)
    for name in want.weight_map:
        a, b = made.load(name), want.load(name)
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
    assert (dst / "tokenizer.json").read_bytes() == (checkpoints["one"] / "tokenizer.json").read_bytes()
    assert "exists; convert writes a new directory" in refused(capsys, "convert", "--layout", "v3", checkpoints["one"], dst)
    assert "already in DeepSeek-V3's layout" in refused(capsys, "convert", "--layout", "v3", dst, tmp_path / "again")
    assert not (tmp_path / "again").exists() and sorted(p.name for p in (tmp_path / "made").iterdir()) == ["v3"]
