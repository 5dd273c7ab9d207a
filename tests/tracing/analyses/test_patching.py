"""Activation patching between two prompts: identities any correct implementation satisfies, the
command line's table and summary, and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from tracing import TraceRequest, run
from tracing.analyses.patching import COLUMNS, METHODS, sweep
from tracing.cli.commands import main
from tracing.errors import InputError

CLEAN = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12]
CORRUPT = [7, 3, 99, 41, 250, 18, 9, 77, 301, 12]  # differs at position 6 only
LAST = [7, 3, 99, 41, 250, 18, 6, 77, 301, 13]  # differs at the last position only


def swept(model, clean, corrupt, **options):
    return sweep(lambda r: run(model, r), TraceRequest(token_ids=clean), TraceRequest(token_ids=corrupt), **options)


@pytest.fixture(scope="module")
def before_and_at(tiny_model):
    return swept(tiny_model, CLEAN, CORRUPT, positions="5:7")  # one position before the difference, and its own


def test_patching_before_the_first_differing_position_changes_nothing(before_and_at):
    table, summary = before_and_at.table, before_and_at.summary
    assert summary["differing_positions"] == [6] and set(table["site"]) == {
        "resid_pre",
        "attn_out",
        "ffn_out",
        "heads",
        "experts",
    }
    before = table[table["position"] < 6]
    assert len(before) and (before["value"] == 0).all()
    assert (before["logit_diff"] == summary["corrupt"]["logit_diff"]).all()  # bit for bit the corrupt run's


def test_patching_the_differing_positions_stream_restores_the_clean_answer(before_and_at):
    first = before_and_at.table.query("site == 'resid_pre' and block == 0 and position == 6")
    assert first["value"].tolist() == [1.0]  # the only difference, put back where it enters


def test_the_whole_last_stream_restores_the_clean_logit_difference_in_every_block(tiny_model):
    result = swept(tiny_model, CLEAN, LAST, sites="resid_pre", positions="last")
    assert list(result.table.columns) == COLUMNS and len(result.table) == tiny_model.args.n_layers
    assert (result.table["value"] == 1.0).all()
    assert (result.table["logit_diff"] == result.summary["clean"]["logit_diff"]).all()


def test_heads_and_experts_are_patched_one_at_a_time(before_and_at, tiny_model):
    cfg = tiny_model.args
    at = before_and_at.table[before_and_at.table["position"] == 6]
    heads = at[at["site"] == "heads"]
    assert sorted(set(heads["index"])) == list(range(cfg.n_heads)) and len(heads) == cfg.n_layers * cfg.n_heads
    experts = at[at["site"] == "experts"]
    assert set(experts["block"]) == set(range(cfg.n_dense_layers, cfg.n_layers))
    assert experts.groupby("block").size().between(cfg.n_activated_experts, 2 * cfg.n_activated_experts).all()
    assert experts["value"].abs().max() > 0


def test_prompts_of_two_lengths_and_absurd_sweeps_are_refused(tiny_model):
    with pytest.raises(InputError, match="has 10 tokens and the corrupt one 9"):
        swept(tiny_model, CLEAN, CORRUPT[:-1])
    with pytest.raises(InputError, match="exceed --max-runs 10"):
        swept(tiny_model, CLEAN, CORRUPT, max_runs=10)
    with pytest.raises(InputError, match="--sites"):
        swept(tiny_model, CLEAN, CORRUPT, sites="mlp")
    with pytest.raises(InputError, match="both token"):
        swept(tiny_model, CLEAN, CORRUPT, target=5, contrast=5)


def test_the_command_writes_the_table_and_both_runs_summary(tiny_checkpoint, tmp_path, capsys):
    ids = [",".join(map(str, p)) for p in (CLEAN, CORRUPT)]
    base = ["patching", "--checkpoint", str(tiny_checkpoint), "--clean-ids", ids[0], "--corrupt-ids", ids[1]]
    out = tmp_path / "sweep"
    assert main([*base, "--sites", "resid_pre,ffn_out", "--positions", "6", "--out", str(out), "--parquet"]) == 0
    table = pd.read_csv(out / "patching.csv")
    assert list(table.columns) == COLUMNS and set(table["site"]) == {"resid_pre", "ffn_out"}
    assert table.equals(pd.read_parquet(out / "patching.parquet"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["runs"] == len(table) and {"clean", "corrupt", "target", "contrast"} <= set(summary)
    assert "runs in" in capsys.readouterr().err and set(table["method"]) == {"exact"}
    assert main([*base, "--method", "gradients", "--out", str(tmp_path / "y")]) == 2
    err = capsys.readouterr().err
    assert "--method 'gradients': choose from exact, gradient" in err and err.count("\n") == 1
    assert not (tmp_path / "y").exists()
    short = ["patching", "--checkpoint", str(tiny_checkpoint), "--clean-ids", ids[0], "--corrupt-ids", "1,2,3"]
    assert main([*short, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "10 tokens and the corrupt one 3" in err and err.count("\n") == 1


def test_the_gradient_method_estimates_the_exact_sweep_from_one_backward(tiny_model):
    """Near the output the logit difference is close to linear in the patched value: there the
    first-order estimate must track the patched runs, cell for cell."""
    exact, gradient = (swept(tiny_model, CLEAN, LAST, sites="ffn_out,experts", positions="last", method=m) for m in METHODS)
    keys = ["site", "block", "position", "index"]
    assert list(gradient.table.columns) == COLUMNS and gradient.table[keys].equals(exact.table[keys])
    assert set(exact.table["method"]) == {"exact"} and set(gradient.table["method"]) == {"gradient"}
    # the backward's forward is the default forward, bit for bit
    assert gradient.summary["corrupt"]["logit_diff"] == exact.summary["corrupt"]["logit_diff"]
    assert gradient.summary["runs"] == 2 and exact.summary["runs"] == len(exact.table) == gradient.summary["cells"] > 5
    assert np.corrcoef(exact.table["value"], gradient.table["value"])[0, 1] > 0.95


@pytest.mark.slow  # about 20 s on two shared cores: the demo's exact sweep, one forward per cell
def test_on_the_demo_the_gradient_tracks_the_exact_sweep():
    """The bundled demo's first pair (docs/attribution.md): over every cell, the estimate correlates
    with the patched runs as the docs say."""
    from tracing.cli.loading import DEMO, open_checkpoint

    demo = open_checkpoint(DEMO)
    pair = [TraceRequest(prompt=p) for p in ("Anne had not seen Captain", "Anne had not seen Colonel")]
    exact, gradient = (sweep(lambda r: run(demo.model, r, demo.tokenizer), *pair, method=m) for m in METHODS)
    assert len(exact.table) == len(gradient.table) == 241
    assert np.corrcoef(exact.table["value"], gradient.table["value"])[0, 1] > 0.9
