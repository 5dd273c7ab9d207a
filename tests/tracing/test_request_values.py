"""A request's values by one rule everywhere: the command line refuses what the server refuses
(tests/tracing/test_server.py), and a value the rule lets through runs."""

from __future__ import annotations

import pytest
import torch

from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import IndexTopK, NoGateBias, check_patch
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.sampling import MIN_TEMPERATURE, Sampling, choose


def test_the_command_line_refuses_a_subnormal_temperature(app_checkpoint, tmp_path, capsys):
    out = tmp_path / "t.safetensors"
    argv = ["run", "--checkpoint", app_checkpoint, "--token-ids", "1,2,3", "--generate", "2", "--out", str(out)]
    assert main([*argv, "--temperature", "1e-320"]) == 2 and not out.exists()
    assert "--temperature must be 0 (greedy) or a finite number of at least 1.18e-38" in capsys.readouterr().err


def test_the_smallest_temperature_samples_the_most_likely_token():
    logits = torch.tensor([3.0, 9.5, -2.0, 9.25, float("-inf")])
    generator = Sampling(MIN_TEMPERATURE, seed=0).generator()
    assert {choose(logits, Sampling(MIN_TEMPERATURE, seed=0), generator) for _ in range(20)} == {1}
    with pytest.raises(InputError, match="at least"):
        Sampling(MIN_TEMPERATURE / 2)


@pytest.mark.parametrize(
    "spec, words",
    [
        ({"no_bias": "x"}, "no_bias: expected"),
        ({"no_bias": 5}, "no_bias: expected"),
        ({"no_bias": [1, True]}, "no_bias: expected"),
        ({"attention": 2.7}, "attention: expected"),
        ({"attention": 2.0}, "attention: expected"),
        ({"attention": True}, "attention: expected"),
        ({"attention": 0}, "attention: expected"),
        ({"ablate": {"1": None}}, "blocks and ids must be integers"),
        ({"ablate_heads": {"1": "23"}}, "blocks and ids must be integers"),
    ],
)
def test_an_intervention_value_of_the_wrong_kind_is_refused(spec, words):
    with pytest.raises(InputError, match=words):
        from_spec(spec)


def test_the_values_the_rule_lets_through_are_the_interventions_asked():
    assert from_spec({"no_bias": [1, 2], "attention": 3}) == [NoGateBias((1, 2)), IndexTopK(3)]


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.bool, torch.complex64])
def test_a_patch_of_a_dtype_no_run_takes_is_refused(dtype):
    with pytest.raises(InputError, match="a patch holds float32"):
        check_patch("layers.0.resid_pre", torch.zeros(2, 4).to(dtype))
    check_patch("layers.0.resid_pre", torch.zeros(2, 4, dtype=torch.float16))
