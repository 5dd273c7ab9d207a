"""One request object, checked in one place and run by one function: the command line, the app and
the JSON wire build the same TraceRequest, and run() gives what the engine gives."""

import pytest
import torch

from tracing.analyses.attribution import AttributionRequest
from tracing.analyses.intervention_specs import from_spec
from tracing.cli.commands import build_parser
from tracing.cli.run import request_from_args
from tracing.errors import InputError
from tracing.runner import TraceRequest, run, trace_tokens
from tracing.sampling import Sampling

IDS = (5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3)


def test_run_is_the_engine_with_the_request_resolved(tiny_model):
    """Generation, sampling, attribution and interventions from the request give the trace the
    engine gives with them resolved by hand, bit for bit."""
    spec = {"ablate_heads": "1:0", "no_bias": "all", "attention": 8}
    request = TraceRequest(
        token_ids=IDS, generate=3, temperature=0.7, top_p=0.9, seed=4, attribute=True, position=5, target=17, interventions=spec
    )
    got = run(tiny_model, request)
    want = trace_tokens(
        tiny_model,
        list(IDS),
        generate=3,
        sampling=Sampling(0.7, 0.9, 4),
        attribution=AttributionRequest(5, 17, None),
        interventions=from_spec(spec),
    )
    assert got.tensors.keys() == want.tensors.keys() and got.extra == want.extra
    for name, value in want.tensors.items():
        assert torch.equal(got[name], value), name


def test_the_command_line_builds_the_request_its_flags_say():
    argv = [
        "run", "--synthetic", "x.json", "--token-ids", "1,2,3", "--out", "t.safetensors", "--generate", "4",
        "--temperature", "0.5", "--seed", "9", "--attribute", "--target", "7", "--zero-experts", "1:2",
        "--dense-attention", "--record", "default,flow",
    ]  # fmt: skip
    request = request_from_args(build_parser().parse_args(argv))
    assert request == TraceRequest(
        token_ids=(1, 2, 3),
        generate=4,
        temperature=0.5,
        seed=9,
        attribute=True,
        target="7",
        interventions={"zero_experts": "1:2", "attention": "dense"},
        record=("default", "flow"),
    )
    assert request.analyses == {"attribution", "flow"}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({}, "a prompt or token ids"),
        ({"prompt": "x", "token_ids": (1,)}, "a prompt or token ids"),
        ({"prompt": "  "}, "the prompt is empty"),
        ({"token_ids": (1,), "chat": True}, "--chat wraps a --prompt"),
        ({"prompt": "x", "thinking": True}, "--thinking applies to --chat"),
        ({"token_ids": (1,), "temperature": 0.5}, "--temperature applies to --generate"),
        ({"token_ids": (1,), "seed": 3}, "--seed applies to --generate"),
        ({"token_ids": (1,), "position": 0}, "--position applies to --attribute"),
        ({"token_ids": (1,), "target": "a"}, "--target applies to --attribute"),
        ({"token_ids": (1,), "generate": 2, "top_p": 0.0}, "--top-p must be in"),
        ({"token_ids": (1,), "generate": -1}, "--generate must be 0 or more"),
        ({"token_ids": (1,), "record": ""}, "--record names no site"),
        ({"token_ids": (1,), "interventions": {"lobotomy": "1:1"}}, "unknown intervention 'lobotomy'"),
        ({"token_ids": (1,), "interventions": {"ablate": "one:two"}}, "--ablate-experts"),
        ({"token_ids": (1,), "generate": 2, "patches": {"layers.0.resid_pre": torch.zeros(1, 8)}}, "--patch applies"),
    ],
)
def test_a_setting_without_what_it_belongs_to_is_refused_in_one_place(fields, message):
    """Every option is checked by TraceRequest.check, before any model is loaded; a setting that
    belongs to another (sampling to --generate, a position to --attribute) is refused without it."""
    with pytest.raises(InputError, match=message):
        TraceRequest(**fields).check()


def test_the_json_form_carries_every_field_but_the_patches():
    request = TraceRequest(
        prompt="It is", chat=True, thinking=True, record=("default", "flow"), prefill=2, generate=3, temperature=0.5,
        top_p=0.9, seed=1, attribute=True, position=1, target=" truth", contrast=7,
        interventions={"ablate": {"1": [2, 3]}, "no_bias": "all"},
    )  # fmt: skip
    again = TraceRequest.from_json(request.to_json())
    assert again == request and again.interventions == request.interventions
    with pytest.raises(InputError, match="unknown request field 'promt'"):
        TraceRequest.from_json('{"promt": "x"}')
    with pytest.raises(InputError, match="'generate' has the wrong type"):
        TraceRequest.from_json('{"token_ids": [1], "generate": "4"}')
    with pytest.raises(InputError, match="'token_ids' must be a list of int"):
        TraceRequest.from_json('{"token_ids": [1, true]}')
    with pytest.raises(InputError, match="not JSON"):
        TraceRequest.from_json("[" * 100_000)
    with pytest.raises(InputError, match="NaN or infinity"):
        TraceRequest(token_ids=(1,), generate=1, temperature=float("inf")).to_json()


def test_logits_all_records_every_positions_logits_as_documented(tiny_model):
    """`--record logits.all` is a documented site: [T, V], its last row the model's last logits, on the
    prefill and through the decode path alike."""
    import torch

    from tracing.runner import trace_tokens

    ids = [7, 3, 99, 41, 250, 18, 6]
    whole = trace_tokens(tiny_model, ids, record=["logits.all", "logits.last"])
    assert whole["logits.all"].shape == (len(ids), tiny_model.args.vocab_size)
    assert torch.equal(whole["logits.all"][-1], whole["logits.last"])
    decoded = trace_tokens(tiny_model, ids, record=["logits.all", "logits.last"], prefill=4, generate=2)
    assert decoded["logits.all"].shape == (len(ids) + 2, tiny_model.args.vocab_size)
    torch.testing.assert_close(decoded["logits.all"][:4], whole["logits.all"][:4], atol=0.05, rtol=0.02)  # the prefill
    assert torch.equal(decoded["logits.all"][-1], decoded["logits.last"])  # the last decode step's
