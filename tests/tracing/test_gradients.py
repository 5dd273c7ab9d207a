"""A run's gradient (``gradient_of``, the grad.* sites): the forward it takes is the default one, bit
for bit; without FP8 rounding it is the derivative a finite difference measures; the refusals."""

from __future__ import annotations

import pytest
import torch

from model import TINY
from model.checkpoint import load_model
from tracing import TraceRequest, run
from tracing.errors import InputError

IDS = [7, 3, 99, 41, 250, 18, 9, 77, 301, 12]
TARGET, CONTRAST = 5, 9


def test_the_gradient_run_computes_the_default_forward_bit_for_bit(tiny_model):
    plain = run(tiny_model, TraceRequest(token_ids=IDS))
    taken = run(tiny_model, TraceRequest(token_ids=IDS, gradient_of=(TARGET, CONTRAST)))
    assert set(plain.tensors) < set(taken.tensors)
    for name, value in plain.tensors.items():
        assert torch.equal(value, taken[name]), name
    grads = [name for name in taken.tensors if ".grad." in name]
    assert len(grads) == 5 * TINY.n_layers - TINY.n_dense_layers  # routed_out in the MoE blocks only
    assert all(taken[name].abs().sum() > 0 for name in grads if "layers.0." in name)
    difference = float(plain["logits.last"][TARGET] - plain["logits.last"][CONTRAST])
    assert taken.extra["gradient"] == {"target": TARGET, "contrast": CONTRAST, "logit_diff": difference}


def test_without_fp8_rounding_the_gradient_is_the_derivative(tiny_source):
    """Float32 activations, no FP8 rounding: the model is smooth around the run (the selections
    held), so grad . delta is the change of the logit difference along delta, to first order."""
    model = load_model(tiny_source, dtype=torch.float32)
    unrounded = {"no_act_fp8": True}
    sites = ("layers.0.resid_pre", "layers.2.attn.head_out")
    base = TraceRequest(token_ids=IDS, record=(*sites, "logits.last"), interventions=unrounded)
    taken = run(model, TraceRequest(**{**base.__dict__, "gradient_of": (TARGET, CONTRAST)}))
    low = float(taken["logits.last"][TARGET] - taken["logits.last"][CONTRAST])
    step = 1e-3
    for site in sites:
        delta = torch.zeros_like(taken[site])
        delta[-1] = torch.randn(delta[-1].shape, generator=torch.Generator().manual_seed(1))  # the last position
        moved = run(
            model,
            TraceRequest(
                token_ids=IDS, record=("logits.last",), interventions=unrounded, patches={site: taken[site] + step * delta}
            ),
        )
        measured = (float(moved["logits.last"][TARGET] - moved["logits.last"][CONTRAST]) - low) / step
        block, suffix = site.split(".", 2)[1:]
        estimated = float((taken[f"layers.{block}.grad.{suffix}"] * delta).sum())
        assert abs(estimated) > 1e-3 and estimated == pytest.approx(measured, rel=0.05), site


@pytest.mark.parametrize(
    "request_, words",
    [
        (TraceRequest(token_ids=IDS, gradient_of=(5, 5)), "both token 5"),
        (TraceRequest(token_ids=IDS, gradient_of=(5,)), "two token ids"),
        (TraceRequest(token_ids=IDS, gradient_of=(5, 9), generate=2), "cannot be combined with --generate"),
        (TraceRequest(token_ids=IDS, gradient_of=(5, 10**6)), "outside the vocabulary"),
        (TraceRequest(token_ids=IDS, record=("layers.*.grad.ffn_out",)), "give gradient_of"),
    ],
)
def test_a_gradient_that_cannot_be_taken_is_one_line(tiny_model, request_, words):
    with pytest.raises(InputError, match=words):
        run(tiny_model, request_)


def test_a_gradient_request_travels_as_json():
    request = TraceRequest(token_ids=IDS, record=("layers.*.grad.resid_pre",), gradient_of=(5, 9))
    assert TraceRequest.from_json(request.to_json()) == request
    with pytest.raises(InputError, match="gradient_of"):
        TraceRequest.from_json('{"token_ids": [1], "gradient_of": [1, "x"]}')
