"""--no-act-fp8: FP8 products without the activations' rounding, in one run's passes only. The flag
changes the model's numbers (and so it can move selections), the product it makes is the
non-quantising reference's (x times the weight dequantised to x's dtype), a normal run after it or
beside it in another thread is bit for bit a fresh one, also after an exception, and the flag goes
through the command line, the Python API, the model server's wire and the app."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from model import fp8, kernels
from tests.app.apptest import messages, start
from tests.tracing.serving import in_process, post
from tracing.analyses.intervention_specs import from_spec
from tracing.analyses.interventions import HookFunctions, NoActFP8
from tracing.cli.commands import main
from tracing.cli.loading import open_checkpoint
from tracing.client import read_answer
from tracing.errors import InputError
from tracing.runner import TraceRequest, run, trace_tokens
from tracing.trace import Trace

PROMPT = "It is a truth universally acknowledged, that a single man"


def traced(model, tokens, interventions=()) -> dict[str, torch.Tensor]:
    return trace_tokens(model, tokens[0].tolist(), record="default", interventions=interventions).tensors


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, differ


@pytest.mark.parametrize("weight_fmt", ["ue8m0", None], ids=["pow2-scales", "other-scales"])
@pytest.mark.parametrize("plain", [False, True], ids=["cpu-route", "plain"])
def test_an_fp8_product_takes_x_unrounded_by_the_dequantised_weight(plain, weight_fmt):
    w, s = fp8.weight_quant(torch.randn(256, 384), weight_fmt)
    x = torch.randn(3, 384, dtype=torch.bfloat16)
    with kernels.plain(plain):
        rounded = kernels.linear(x, w, s, "ue8m0")
        with fp8.unrounded_activations():
            unrounded = kernels.linear(x, w, s, "ue8m0")
            assert kernels.fake_quant(x, "ue8m0") is x  # the MLA latent skips its FP8 simulation
            q, scale = fp8.quantised(x, "ue8m0")  # the indexer's q and k stay as they are
            assert q is x and torch.equal(scale, torch.ones(3, 1))
        assert torch.equal(kernels.linear(x, w, s, "ue8m0"), rounded)  # rounding again after the context
    want = F.linear(x.float(), fp8.weight_dequant(w, s, torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.allclose(unrounded.float(), want.float(), rtol=1e-2, atol=1e-2)  # bf16 products: summation order
    assert not torch.equal(unrounded, rounded)


def test_the_flag_changes_the_run_and_leaves_no_trace_after_it(tiny_model, tokens):
    before = traced(tiny_model, tokens)
    unrounded = traced(tiny_model, tokens, [NoActFP8()])
    assert not torch.equal(unrounded["logits.last"], before["logits.last"])
    assert torch.equal(unrounded["layers.0.resid_pre"], before["layers.0.resid_pre"])  # the embedding is no product
    assert_bit_identical(traced(tiny_model, tokens), before)
    assert fp8.rounds_activations()


def test_an_exception_inside_the_run_restores_the_rounding(tiny_model, tokens):
    before = traced(tiny_model, tokens)

    def fail(value, ctx):
        raise InputError("stop here")

    with pytest.raises(InputError, match="stop here"):
        traced(tiny_model, tokens, [NoActFP8(), HookFunctions({"layers.1.attn_out": fail})])
    assert fp8.rounds_activations()
    assert_bit_identical(traced(tiny_model, tokens), before)


def test_another_thread_rounds_while_one_runs_unrounded(tiny_model, tokens):
    before = traced(tiny_model, tokens)
    beside: dict = {}
    with fp8.unrounded_activations():
        thread = threading.Thread(target=lambda: beside.update(traced(tiny_model, tokens)))
        thread.start()
        thread.join()
    assert_bit_identical(beside, before)


def test_the_spec_reads_a_boolean_only():
    assert from_spec({"no_act_fp8": True}) == [NoActFP8()] and from_spec({"no_act_fp8": False}) == []
    with pytest.raises(InputError, match="no_act_fp8: expected true or false"):
        from_spec({"no_act_fp8": "yes"})


def test_the_command_line_and_python_give_the_same_trace(demo_run, app_checkpoint, tmp_path):
    loaded = open_checkpoint(app_checkpoint)
    request = TraceRequest(prompt=PROMPT, interventions={"no_act_fp8": True})
    python = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
    cli = Trace.load(demo_run(["--no-act-fp8"]))
    plain = Trace.load(demo_run([]))
    assert cli.extra["interventions"] == python.extra["interventions"] == ["no FP8 activation rounding"]
    assert_bit_identical(cli.tensors, python.tensors)
    assert not torch.equal(cli["logits.last"], plain["logits.last"])


@pytest.fixture(scope="module")
def demo_run(app_checkpoint, tmp_path_factory):
    directory = tmp_path_factory.mktemp("no_act_fp8")

    def go(flags: list[str]) -> str:
        out = str(directory / f"run{len(list(directory.iterdir()))}.safetensors")
        assert main(["run", "--checkpoint", app_checkpoint, "--prompt", PROMPT, *flags, "--out", out]) == 0
        return out

    return go


def test_the_server_wire_carries_it(app_checkpoint):
    with in_process(app_checkpoint) as (client, _, loaded):
        request = TraceRequest(prompt=PROMPT, interventions={"no_act_fp8": True})
        answer = post(client, request)
        assert answer.status_code == 200
        want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
        served = read_answer(iter([answer.content]))
        assert served == want.to_bytes()
        assert Trace.from_bytes(served).extra["interventions"] == ["no FP8 activation rounding"]
        bad = client.post(
            "/trace",
            content=b'{"prompt": "x", "interventions": {"no_act_fp8": 1}}',
            headers={"content-type": "application/json"},
        )
        assert bad.status_code == 422 and "no_act_fp8" in bad.text


def test_the_app_runs_it_from_the_interventions_page(app_checkpoint, monkeypatch):
    from tests.app.test_app_interventions import PAGE, baseline_entry, intervened_entry, metrics, run

    at = start(monkeypatch, app_checkpoint, PAGE)
    at.toggle(key="iv_no_act_fp8").set_value(True).run()
    run(at)
    assert not at.error, messages(at.error)
    iv, base = intervened_entry(at).trace, baseline_entry(at).trace
    assert iv.extra["interventions"] == ["no FP8 activation rounding"]
    assert not torch.equal(iv["logits.last"], base["logits.last"])
    assert "Next-token KL" in metrics(at)
    assert at.query_params["iv_no_act_fp8"] == "1"  # in the link
    at.button(key="iv_clear").click().run()
    assert at.toggle(key="iv_no_act_fp8").value is False
