"""The loss under an intervention: ``eval`` and ``evaluate(..., interventions=)`` apply it to every
window, exactly as a traced run of the same window applies it."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from model.checkpoint import load_model
from tracing.analyses.evaluate import evaluate
from tracing.analyses.intervention_specs import from_spec
from tracing.cli.commands import main
from tracing.cli.loading import resolve_checkpoint
from tracing.runner import trace_tokens
from tracing.tokenizer import Tokenizer

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def test_a_window_scored_under_an_intervention_is_the_traced_runs_loss(app_checkpoint):
    directory = resolve_checkpoint(app_checkpoint)
    model, tokenizer = load_model(directory), Tokenizer(directory)
    ids = tokenizer.encode(TEXT)  # BOS first: one window of every token
    spec = {"ablate": "1:0,1:3", "no_bias": "all"}
    scored = evaluate(model, tokenizer, TEXT, context=len(ids), interventions=from_spec(spec))
    traced = trace_tokens(model, ids, record="logits.all", interventions=from_spec(spec))
    logits = traced["logits.all"][:-1]  # (T - 1, V): each position predicts the next
    want = float(F.cross_entropy(logits, torch.tensor(ids[1:])))
    assert abs(scored["mean_nll"] - want) < 1e-4 and scored["interventions"] == ["no correction bias", "ablate 1:0, 1:3"]
    plain = evaluate(model, tokenizer, TEXT, context=len(ids))
    assert plain["mean_nll"] != scored["mean_nll"] and "interventions" not in plain


def test_eval_takes_the_intervention_flags(app_checkpoint, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(TEXT, encoding="utf-8")
    base = ["eval", "--checkpoint", app_checkpoint, "--text-file", str(text)]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*base, "--ablate-experts", "1:0", "--dense-attention"]) == 0
    changed = json.loads(capsys.readouterr().out)
    assert changed["interventions"] == ["ablate 1:0", "dense attention"] and changed["mean_nll"] != plain["mean_nll"]
    assert main([*base, "--zero-experts", "1:0@3"]) == 2
    assert "applies to run" in capsys.readouterr().err


def test_eval_streamed_scores_as_the_loaded_model(app_checkpoint, tmp_path, capsys):
    """``eval --stream`` (the 671B on one GPU): every batch's forward reads the blocks again, nothing
    kept between passes here, and the scores are the loaded model's, over several windows."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join([TEXT] * 16), encoding="utf-8")  # about 300 tokens: two windows of the demo's 256
    base = ["eval", "--checkpoint", app_checkpoint, "--text-file", str(text), "--ablate-experts", "1:0"]
    assert main(base) == 0
    loaded = json.loads(capsys.readouterr().out)
    assert main([*base, "--stream", "--device-budget", "0", "--host-budget", "0"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed == loaded and loaded["tokens"] > loaded["context"]
