"""Generation: greedy and sampled tokens fed back through the decode path, traced at every step."""

import numpy as np
import pytest
import torch

from model.checkpoint import load_model
from tracing.cli.commands import main
from tracing.runner import trace_tokens
from tracing.sampling import Sampling
from tracing.tables.frames import steps_table, tokens_table
from tracing.trace import Trace

PROMPT = [5, 17, 300, 2, 9, 44, 123, 7]


@pytest.fixture(scope="module")
def greedy(tiny_model):
    return trace_tokens(tiny_model, PROMPT, generate=6)


def test_greedy_generation_writes_the_top_next_token(greedy):
    ids, top = greedy.token_ids, greedy["next.topk_indices"]
    assert len(ids) == len(PROMPT) + 6 and ids[: len(PROMPT)] == PROMPT
    assert all(ids[p] == int(top[p - 1, 0]) for p in range(len(PROMPT), len(ids)))
    assert greedy.extra["generation"] == {"start": 8, "requested": 6, "generated": 6, "stopped": "length", "temperature": 0.0}
    probs = greedy["next.topk_probs"]
    assert probs.shape == (len(ids), 10) and (probs[:, :-1] >= probs[:, 1:]).all() and (probs.sum(1) <= 1 + 1e-6).all()
    assert torch.equal(greedy["next.token_prob"][len(PROMPT) - 1 : -1], probs[len(PROMPT) - 1 : -1, 0])


def test_a_generation_is_the_decode_path_of_its_tokens(tiny_model, greedy):
    """Teacher-forcing the generated ids through --prefill gives the same trace, bit for bit."""
    forced = trace_tokens(tiny_model, greedy.token_ids, prefill=len(PROMPT))
    assert set(forced.tensors) == set(greedy.tensors)
    for name, value in greedy.tensors.items():
        assert torch.equal(forced[name], value), name


def test_the_next_token_sites_in_a_prefill_are_the_models_logits(tiny_model):
    trace = trace_tokens(tiny_model, PROMPT)
    with torch.inference_mode():
        logits = tiny_model(torch.tensor([PROMPT]), all_logits=True)[0]  # (T, V)
    probs = logits.softmax(-1)
    top = trace["next.topk_indices"]
    assert torch.equal(top[-1], logits[-1].topk(10).indices)
    torch.testing.assert_close(trace["next.topk_probs"], probs.gather(1, top), rtol=1e-5, atol=1e-7)
    following = torch.tensor(PROMPT[1:])
    torch.testing.assert_close(trace["next.token_prob"][:-1], probs[:-1].gather(1, following[:, None])[:, 0])
    torch.testing.assert_close(trace["next.entropy"], -(probs * probs.log()).sum(-1), rtol=1e-4, atol=1e-5)


def test_sampling_is_reproducible_with_a_seed(tiny_model):
    run = lambda seed: trace_tokens(tiny_model, PROMPT, generate=6, sampling=Sampling(1.0, 0.9, seed)).token_ids  # noqa: E731
    assert run(3) == run(3)
    assert len({tuple(run(seed)) for seed in (1, 2, 3, 4)}) > 1
    tiny = trace_tokens(tiny_model, PROMPT, generate=4, sampling=Sampling(1.0, 1e-9, 7))  # only the top token left
    assert tiny.token_ids == trace_tokens(tiny_model, PROMPT, generate=4).token_ids
    assert tiny.extra["generation"]["seed"] == 7 and tiny.extra["generation"]["top_p"] == 1e-9
    drawn = trace_tokens(tiny_model, PROMPT, generate=2, sampling=Sampling(0.7))
    seed = drawn.extra["generation"]["seed"]  # drawn, recorded: the run can be repeated
    assert trace_tokens(tiny_model, PROMPT, generate=2, sampling=Sampling(0.7, seed=seed)).token_ids == drawn.token_ids


def test_generate_zero_is_a_plain_run(tiny_model):
    assert trace_tokens(tiny_model, PROMPT, generate=0).to_bytes() == trace_tokens(tiny_model, PROMPT).to_bytes()


def test_generation_stops_after_the_end_of_sequence_token(tiny_source, greedy):
    model = load_model(tiny_source)
    model.args = model.args.replace(eos_token_id=greedy.token_ids[len(PROMPT) + 1])  # the second token it writes
    trace = trace_tokens(model, PROMPT, generate=6)
    assert trace.token_ids == greedy.token_ids[: len(PROMPT) + 2]
    assert trace.extra["generation"]["stopped"] == "eos" and trace.extra["generation"]["generated"] == 2


def test_steps_and_tokens_tables_show_the_phases(greedy):
    steps = steps_table(greedy)
    assert len(steps) == greedy.n_tokens and np.isnan(steps.chosen_prob[0])
    assert list(steps.phase) == ["prefill"] * len(PROMPT) + ["decode"] * 6
    written = steps[steps.generated]
    assert len(written) == 6 and (written.alt1 == written.token).all()
    np.testing.assert_allclose(written.chosen_prob, written.alt1_prob)
    assert {"entropy", "alt10", "alt10_prob"} <= set(steps.columns)
    assert list(tokens_table(greedy).phase[-7:]) == ["prefill"] + ["decode"] * 6


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--generate", "-1"], "--generate must be 0 or more"),
        (["--generate", "2", "--temperature", "-0.5"], "--temperature must be 0"),
        (["--generate", "2", "--temperature", "1", "--top-p", "0"], r"--top-p must be in \(0, 1\]"),
        (["--generate", "2", "--temperature", "1", "--top-p", "1.5"], r"--top-p must be in \(0, 1\]"),
        (["--generate", "20000"], "exceed the"),
    ],
)
def test_bad_generation_settings_exit_2(capsys, tiny_checkpoint, tmp_path, argv, message):
    import re

    out = tmp_path / "t.safetensors"
    code = main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", "--out", str(out), *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and re.search(message, err[0]), err
    assert not out.exists()


def test_the_cli_generates_and_records_the_settings(capsys, tiny_checkpoint, tmp_path):
    out = tmp_path / "t.safetensors"
    argv = [
        "run",
        "--checkpoint",
        str(tiny_checkpoint),
        "--token-ids",
        "1,2,3",
        "--out",
        str(out),
        "--csv",
        str(tmp_path / "csv"),
    ]
    assert main([*argv, "--generate", "4", "--temperature", "0.8", "--top-p", "0.95", "--seed", "11"]) == 0
    trace = Trace.load(out)
    assert trace.n_tokens == 7 and trace.extra["generation"]["seed"] == 11
    assert (tmp_path / "csv" / "steps.csv").read_text().startswith("position,phase,generated,token_id,token,chosen_prob")
