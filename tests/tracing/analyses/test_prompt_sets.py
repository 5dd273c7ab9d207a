"""Statistics over prompt sets: the bootstrap's interval (seeded, over prompts, weighted by positions),
the checked reading of pairs and prompt files, and the three analyses over a set (patching over pairs,
the causal check, the loss of an intervention), each against the single-prompt analysis it averages."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import tracing
from tracing import TraceRequest
from tracing.analyses import prompt_sets as sets
from tracing.analyses.bootstrap import bootstrap
from tracing.analyses.evaluate import evaluate
from tracing.analyses.patching import sweep
from tracing.cli.commands import main
from tracing.cli.loading import open_checkpoint
from tracing.errors import InputError

PAIRS = [  # one token differs in each, of two lengths
    {"clean": "The cat sat on the mat", "corrupt": "The dog sat on the mat"},
    {"clean": "The quick brown fox", "corrupt": "The quick brown dog"},
    {"clean": "It is a truth", "corrupt": "It is a fact"},
]
PROMPTS = ["The cat sat on the mat and looked at the dog", "It is a truth universally acknowledged that"]


@pytest.fixture(scope="module")
def loaded(app_checkpoint):
    return open_checkpoint(app_checkpoint)


def runner(loaded, calls=None):
    def run(request):
        if calls is not None:
            calls.append(request)
        return tracing.run(loaded.model, request, loaded.tokenizer)

    return run


def jsonl(rows) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def test_the_interval_is_seeded_holds_the_mean_and_weighs_prompts_by_positions():
    values = np.array([[0.1, 1.0], [0.5, np.nan], [0.2, 3.0], [0.9, 2.0]])  # 4 prompts x 2 statistics
    a, b = bootstrap(values, seed=7), bootstrap(values, seed=7)
    many = np.random.default_rng(0).normal(size=(40, 3))  # enough prompts that another seed draws other means
    assert a.equals(b) and bootstrap(many, seed=7).equals(bootstrap(many, seed=7))
    assert not bootstrap(many, seed=7)[["ci_low", "ci_high"]].equals(bootstrap(many, seed=8)[["ci_low", "ci_high"]])
    assert a["n"].tolist() == [4, 3] and a["mean"].tolist() == pytest.approx([0.425, 2.0])
    assert (a["ci_low"] <= a["mean"]).all() and (a["mean"] <= a["ci_high"]).all()
    assert a["ci_low"][0] >= 0.1 and a["ci_high"][0] <= 0.9  # a mean of draws of these values
    # weights: a prompt's mean over its positions, weighted by them, is the mean over every position
    per_position = [np.array([1.0, 2.0, 3.0]), np.array([10.0])]
    weighted = bootstrap([p.mean() for p in per_position], [len(p) for p in per_position])
    assert weighted["mean"][0] == pytest.approx(np.concatenate(per_position).mean())
    single = bootstrap(np.array([0.3, 0.3, 0.3]))  # no spread between prompts: no width
    assert single["ci_low"][0] == single["ci_high"][0] == pytest.approx(0.3)
    with pytest.raises(InputError, match="--resamples"):
        bootstrap(values, resamples=0)
    with pytest.raises(InputError, match="give --resamples 8,388 or fewer"):  # bounded before any draw
        bootstrap(np.zeros(2000), resamples=10_000)


@pytest.mark.parametrize(
    "data, words",
    [
        (b"", "empty"),
        (b"\n  \n", "empty"),
        (jsonl(PAIRS[:1]) + b'{"clean": "a"\n', "line 2: not a JSON object"),
        (jsonl(PAIRS[:1]) + b"[1, 2]\n", "line 2: not a JSON object"),
        (jsonl([*PAIRS[:2], {"clean": "a", "corupt": "b"}]), "line 3: unknown field 'corupt'"),
        (jsonl([{"clean": "a", "corrupt": ""}]), "line 1: 'corrupt' must be a non-empty string"),
        (jsonl([{"clean": "a", "corrupt": "b", "target": 1.5}]), "line 1: 'target' must be a token's text or id"),
        (b"clean,corrupt\na,b\nc\n", "line 3: 1 cells where the header names 2"),
        (b"clean,other\na,b\n", "line 1: a CSV header naming the columns clean, corrupt"),
        (b'clean,corrupt\n"a,b\n', "not CSV"),
        (b"\xff\xfe", "not UTF-8"),
        (b"clean,corrupt\n" + b"a,b\n" * sets.MAX_LINES, "lines, more than 10,000"),
        (b"clean,corrupt\na," + b"b" * sets.MAX_LINE + b"\n", "line 2: 32,770 characters"),
        (b" " * (sets.MAX_BYTES + 1), "more than a file of prompts may hold"),
    ],
)
def test_a_bad_file_of_pairs_is_refused_naming_its_line(data, words):
    with pytest.raises(InputError, match=words.replace("(", r"\(")):
        sets.parse_pairs(data, "pairs.csv")


def test_pairs_and_prompts_read_from_jsonl_csv_and_lines():
    rows = [{**PAIRS[0], "target": " mat", "contrast": 12}, PAIRS[1]]
    assert sets.parse_pairs(jsonl(rows), "p.jsonl") == [
        sets.Pair(1, PAIRS[0]["clean"], PAIRS[0]["corrupt"], " mat", 12),
        sets.Pair(2, PAIRS[1]["clean"], PAIRS[1]["corrupt"]),
    ]
    csv = b'clean,corrupt,target\r\n"a, b",c d,\r\n\r\nx,y,7\r\n'
    assert sets.parse_pairs(csv, "p.csv") == [sets.Pair(1 + 1, "a, b", "c d"), sets.Pair(4, "x", "y", "7")]
    docs = Path(__file__).resolve().parents[3] / "docs" / "examples"  # the docs' sets read as they say
    assert len(sets.parse_pairs((docs / "name_pairs.jsonl").read_bytes(), "name_pairs.jsonl")) == 10
    assert len(sets.parse_prompts((docs / "heldout_passages.jsonl").read_bytes(), "heldout_passages.jsonl")) == 10
    text = "\ufeffone prompt\n\n two \n".encode()
    assert sets.parse_prompts(text, "p.txt") == [sets.Prompt(1, "one prompt"), sets.Prompt(3, " two ")]


def test_the_mean_over_pairs_is_the_mean_of_each_pairs_sweep(tiny_model):
    ids = [  # token ids, as the tiny model has no tokenizer: one differs at the last position, of two lengths
        ("7 3 99 41 250 18 6 77 301 12", "7 3 99 41 250 18 6 77 301 13"),
        ("17 4 66 300 21 90 44 3", "17 4 66 300 21 90 44 5"),
    ]
    pairs = [sets.Pair(i + 1, a, b) for i, (a, b) in enumerate(ids)]
    run = lambda r: tracing.run(tiny_model, r)  # noqa: E731
    request = lambda text: TraceRequest(token_ids=[int(t) for t in text.split()])  # noqa: E731
    result = sets.patching_over_pairs(run, pairs, request, sites="resid_pre,experts", positions="last")
    table, each = result.table, result.each
    alone = sweep(run, request(ids[1][0]), request(ids[1][1]), sites="resid_pre", positions="last")
    mine = each.query("line == 2 and site == 'resid_pre'").reset_index(drop=True)
    assert mine[["block", "position", "value"]].equals(alone.table[["block", "position", "value"]])
    resid = table[table["site"] == "resid_pre"].set_index("block")
    want = each[each["site"] == "resid_pre"].groupby("block")["value"].mean()
    assert resid["mean"].to_numpy() == pytest.approx(want.to_numpy(), rel=1e-12) and (resid["n"] == 2).all()
    assert (resid["mean"] == 1).all()  # the last stream put back restores the answer in every block, pair by pair
    assert (table["ci_low"] <= table["mean"] + 1e-12).all() and (table["mean"] <= table["ci_high"] + 1e-12).all()
    assert (table["from_end"] == -1).all() and (table["position"] == -1).all()  # two lengths: aligned from the end
    # an expert only some pairs' runs chose counts 0 for the others (its patch changes nothing there)
    experts = table[table["site"] == "experts"]
    assert (experts["n"] == 2).all() and experts.groupby("block").size().gt(tiny_model.args.n_activated_experts).any()
    for row in experts.itertuples():
        got = each.query("site == 'experts' and block == @row.block and index == @row.index")["value"]
        assert row.mean == pytest.approx(got.sum() / 2)
    assert result.summary["pairs"] == 2 and result.summary["runs"] == len(each)


def test_pairs_of_two_lengths_are_refused_before_the_first_sweep(loaded):
    calls = []
    bad = [*PAIRS[:2], {"clean": "It is a truth", "corrupt": "It is a lie"}, {"clean": "a b", "corrupt": "a b c d"}]
    pairs = sets.parse_pairs(jsonl(bad), "p.jsonl")
    with pytest.raises(InputError, match=r"line 3: the clean prompt has \d+ tokens and the corrupt one \d+ \(and 1 more"):
        sets.patching_over_pairs(runner(loaded, calls), pairs, n_tokens=lambda r: len(loaded.tokenizer.encode(r.prompt)))
    assert calls == []


def test_the_loss_of_an_intervention_is_paired_and_past_index_topk_holds_all_of_it(loaded, app_checkpoint):
    prompts = [sets.Prompt(i + 1, p) for i, p in enumerate(PROMPTS)]
    fewer = lambda r: dataclasses.replace(r, interventions={"attention": 3})  # noqa: E731
    result = sets.loss_over_prompts(runner(loaded), prompts, changed=fewer)
    table, each = result.table.set_index("measure"), result.each
    # the plain loss of one prompt is eval's loss of the same text (one window, BOS first)
    alone = evaluate(loaded.model, loaded.tokenizer, PROMPTS[0])
    assert each["nll"][0] == pytest.approx(alone["mean_nll"], rel=1e-5) and each["tokens"][0] == alone["tokens"]
    assert table.loc["difference", "mean"] == pytest.approx(table.loc["nll_changed", "mean"] - table.loc["nll", "mean"])
    # before position 3 every query sees at most 3 keys: keeping 3 changes nothing there
    past = table.loc["difference_past_topk"]
    assert result.summary["index_topk"] == 3 and past["tokens"] == (each["tokens"] - 3).sum()
    assert past["mean"] * past["tokens"] == pytest.approx(table.loc["difference", "mean"] * table.loc["difference", "tokens"])
    assert table.loc["difference", "mean"] != 0 and past["ci_low"] <= past["mean"] <= past["ci_high"]


def test_the_commands_refuse_a_bad_line_and_write_the_causal_tables(app_checkpoint, tmp_path, capsys):
    """(patching --pairs and eval --prompts write theirs in tests/tracing/test_server_commands.py, here and on a server)"""
    pairs, prompts = tmp_path / "pairs.jsonl", tmp_path / "prompts.txt"
    pairs.write_bytes(jsonl(PAIRS[:1]) + b'{"clean": 1, "corrupt": "x"}\n')
    prompts.write_text("\n".join(PROMPTS), encoding="utf-8")
    base = ["--checkpoint", app_checkpoint]
    argv = ["patching", *base, "--pairs", str(pairs), "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pairs.jsonl line 2: 'clean' must be a non-empty string" in err and err.count("\n") == 1
    assert main([*argv, "--clean", "a"]) == 2
    assert "--pairs and --clean exclude each other" in capsys.readouterr().err
    assert main(["eval", *base, "--prompts", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err and not (tmp_path / "x").exists()

    csv = tmp_path / "causal"
    assert main(["run", *base, "--prompts", str(prompts), "--attribute", "--causal", "2", "--csv", str(csv)]) == 0
    summary = pd.read_csv(csv / "causal_summary.csv").set_index("measure")
    each = pd.read_csv(csv / "causal.csv")
    assert summary.loc["correlation", "mean"] == pytest.approx(each.groupby("line")["correlation"].first().mean())
    parts = pd.read_csv(csv / "causal_parts.csv")
    assert parts["n"].sum() == len(each) == 4 and summary.loc["sign_agreement", "n"] == 2
    assert "correlation of attributed and measured" in capsys.readouterr().err
    assert main(["run", *base, "--prompts", str(prompts), "--attribute", "--csv", str(csv)]) == 2
    assert "--prompts applies to --attribute --causal N" in capsys.readouterr().err


def test_eval_over_prompts_compares_with_a_graph(app_checkpoint, tmp_path, capsys):
    """docs/examples/mean_ablation.json as the change: each prompt's loss with block 1's attention
    update replaced by its mean, paired with the plain loss; a graph does not run on eval's windows."""
    graph = Path(__file__).resolve().parents[3] / "docs" / "examples" / "mean_ablation.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS), encoding="utf-8")
    base = ["eval", "--checkpoint", app_checkpoint]
    assert main([*base, "--prompts", str(prompts), "--graph", str(graph)]) == 0
    line = json.loads(capsys.readouterr().out)
    assert line["graph"] and line["difference"]["mean"] != 0 and line["difference"]["n"] == 2
    assert line["nll_changed"]["mean"] == pytest.approx(line["nll"]["mean"] + line["difference"]["mean"])
    assert main([*base, "--text-file", str(prompts), "--graph", str(graph)]) == 2
    assert "--graph applies to --prompts" in capsys.readouterr().err


@pytest.mark.slow  # about 45 s on two shared cores: the figures docs/cli.md and docs/attribution.md give
def test_the_docs_figures_on_the_demo(tmp_path, capsys):
    from tests.devcheckpoint import demo_available

    if not demo_available():
        pytest.skip("the bundled demo checkpoint is absent")
    docs = Path(__file__).resolve().parents[3] / "docs" / "examples"
    passages = str(docs / "heldout_passages.jsonl")
    lines = []
    for flags in (["--dense-attention"], ["--index-topk", "16"]):
        assert main(["eval", "--checkpoint", "demo", "--prompts", passages, *flags]) == 0
        lines.append(json.loads(capsys.readouterr().out))
    dense, sixteen = lines
    assert dense["tokens"] == 1067 and dense["past_topk_tokens"] == 427
    assert dense["difference_past_topk"]["ci_low"] < 0 < dense["difference_past_topk"]["ci_high"]
    assert round(sixteen["difference"]["mean"], 3) == 0.051 and sixteen["difference_past_topk"]["ci_low"] > 0
    out = tmp_path / "pairs"
    argv = ["patching", "--checkpoint", "demo", "--pairs", str(docs / "name_pairs.jsonl"), "--positions", "last"]
    assert main([*argv, "--sites", "resid_pre,attn_out,ffn_out,heads", "--out", str(out)]) == 0
    mean = pd.read_csv(out / "patching_mean.csv").set_index(["site", "block", "index"])["mean"]
    assert round(mean[("ffn_out", 0, -1)], 3) == 0.992 and round(mean[("ffn_out", 1, -1)], 3) == 0.206
    assert mean.loc[["heads", "attn_out"]].abs().max() < 0.006
