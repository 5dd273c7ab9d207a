"""Interventions at chosen positions, your own hook functions, and patching one run's values into
another's at chosen positions: what a causal check of one position's attribution needs."""

from __future__ import annotations

import pytest
import torch

from model import TINY
from tracing import TraceRequest, run
from tracing.analyses.intervention_specs import from_spec, parse_positions
from tracing.analyses.interventions import AblateHeads, PatchAt, ZeroExperts
from tracing.cli.commands import main
from tracing.errors import InputError
from tracing.runner import trace_tokens
from tracing.trace import Trace

IDS = [7, 3, 99, 41, 250, 18, 6, 77, 301, 12, 5, 64, 200, 9]  # T=14 > index_topk=8
OTHER = [7, 3, 99, 41, 250, 18, 6, 11, 302, 12, 5, 64, 200, 9]  # differs at positions 7 and 8
AT = 6


@pytest.fixture(scope="module")
def base(tiny_model):
    return trace_tokens(tiny_model, IDS, record="all")


def rows_before(trace: Trace, name: str, n: int) -> torch.Tensor:
    """The rows of positions < n, and of key columns < n where the site has keys (a query's raw
    scores of later keys change with those keys)."""
    value = trace[name][:n]
    return value[..., :n] if name.endswith(("attn.scores", "attn.probs", "indexer.scores")) else value


def positional(trace: Trace) -> list[str]:
    return [n for n, v in trace.tensors.items() if n != "tokens" and v.dim() and v.shape[0] == trace.n_tokens]


@pytest.mark.parametrize(
    "spec",
    [
        {"ablate": f"1:{{e}}@{AT}"},
        {"zero_experts": f"2:{{e}}@{AT}:"},
        {"ablate_heads": f"0:1@{AT},2:0@{AT}:{AT + 3}"},
        {"ablate_heads": {1: [0, 1]}, "at": str(AT)},
    ],
)
def test_a_removal_at_one_position_leaves_the_positions_before_it_bit_identical(tiny_model, base, spec):
    key, value = next(iter(spec.items()))
    if "{e}" in str(value):  # an expert the position chose: its removal changes the run from there
        block = int(value[0])
        spec = {key: value.format(e=int(base[f"layers.{block}.ffn.gate.topk_indices"][AT, 0]))}
    edited = trace_tokens(tiny_model, IDS, record="all", interventions=from_spec(spec))
    for name in positional(base):
        assert torch.equal(rows_before(edited, name, AT), rows_before(base, name, AT)), name
    assert not torch.equal(edited["layers.2.resid_post"][AT:], base["layers.2.resid_post"][AT:])
    assert edited.extra["interventions"][0].endswith(f"at position {AT}") or f"at positions {AT}:" in str(
        edited.extra["interventions"]
    )


def test_a_removal_at_one_position_is_not_the_removal_at_every_position(tiny_model, base):
    expert = int(base["layers.1.ffn.gate.topk_indices"][AT, 0])
    there = trace_tokens(tiny_model, IDS, record="all", interventions=[ZeroExperts({1: (expert,)}, (AT, AT + 1))])
    everywhere = trace_tokens(tiny_model, IDS, record="all", interventions=[ZeroExperts({1: (expert,)})])
    chose = (base["layers.1.ffn.gate.topk_indices"][:AT] == expert).any()
    assert chose, "the expert is chosen before the position too: the two runs must differ there"
    assert torch.equal(there["layers.1.resid_post"][:AT], base["layers.1.resid_post"][:AT])
    assert not torch.equal(everywhere["layers.1.resid_post"][:AT], base["layers.1.resid_post"][:AT])


def test_heads_removed_at_a_position_read_nothing_there_only(tiny_model, base):
    edited = trace_tokens(tiny_model, IDS, record="all", interventions=[AblateHeads({0: (1,)}, (AT, AT + 2))])
    probs = edited["layers.0.attn.probs"]  # (T, H, S)
    assert probs[AT : AT + 2, 1].abs().sum() == 0 and probs[AT + 2 :, 1].sum() > 0 and probs[:AT, 1].sum() > 0


@pytest.mark.parametrize(("text", "expected"), [("5", (5, 6)), ("5:9", (5, 9)), ("5:", (5, None)), (":3", (0, 3))])
def test_positions_read_as_python_ranges(text, expected):
    assert parse_positions("--x", text) == expected


@pytest.mark.parametrize("text", ["", "²", "5:5", "9:2", "a:b", "1:2:3", "-1"])
def test_bad_positions_are_refused_in_one_line(text):
    with pytest.raises(InputError, match="--x"):
        parse_positions("--x", text)


def test_the_flags_take_positions_and_refuse_malformed_ones(tiny_checkpoint, tmp_path, capsys):
    ids = ",".join(map(str, IDS))
    common = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", ids, "--record", "all"]
    assert main([*common, "--out", str(tmp_path / "a.safetensors"), "--ablate-heads", f"0:1@{AT}:"]) == 0
    trace = Trace.load(tmp_path / "a.safetensors")
    assert trace.extra["interventions"] == [f"ablate heads 0:1 at positions {AT}:"]
    assert trace["layers.0.attn.probs"][AT:, 1].abs().sum() == 0 and trace["layers.0.attn.probs"][:AT, 1].sum() > 0
    capsys.readouterr()  # the run's own line
    for bad in ("0:1@", "0:1@x", "0:²@3", "0:1@4:2"):
        assert main([*common, "--out", str(tmp_path / "b.safetensors"), "--ablate-heads", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--ablate-heads" in err and "Traceback" not in err, err


def test_a_hook_function_reads_and_replaces_a_value_and_the_trace_shows_it(tiny_model):
    seen = []

    def silence_last(value, ctx):
        seen.append((ctx.name, list(ctx.positions), tuple(value.shape)))
        out = value.clone()
        out[0, -1] = 0
        return out

    request = TraceRequest(token_ids=IDS, record=("layers.1.attn_out", "layers.1.resid_mid", "logits.last"))
    plain = run(tiny_model, request)
    hooked = run(tiny_model, request, hooks={"layers.1.attn_out": silence_last})
    assert seen == [("layers.1.attn_out", list(range(len(IDS))), (1, len(IDS), TINY.dim))]
    assert hooked["layers.1.attn_out"][-1].abs().max() == 0
    assert torch.equal(hooked["layers.1.attn_out"][:-1], plain["layers.1.attn_out"][:-1])
    assert not torch.equal(hooked["logits.last"], plain["logits.last"])
    assert hooked.extra["interventions"] == ["hooks on layers.1.attn_out"]


def test_a_hook_sees_each_decode_steps_position(tiny_model):
    positions = []
    run(
        tiny_model,
        TraceRequest(token_ids=IDS[:5], generate=3),
        hooks={"layers.0.resid_pre": lambda value, ctx: positions.append(list(ctx.positions))},
    )
    assert positions == [[0, 1, 2, 3, 4], [5], [6], [7]]


@pytest.mark.parametrize(
    ("hooks", "message"),
    [
        ({"layers.1.attn_out": lambda v, ctx: v[..., :3]}, "returned"),
        ({"layers.1.attn_out": lambda v, ctx: v.double()}, "returned"),
        ({"layers.1.attn.indexer.recall": lambda v, ctx: None}, "not a hook point"),
        ({"layers.99.attn_out": lambda v, ctx: None}, "not a hook point"),
        ({"layers.1.attn_out": "not a function"}, "expected a function"),
    ],
)
def test_a_hook_that_cannot_work_is_refused_with_its_name(tiny_model, hooks, message):
    with pytest.raises(InputError, match=message):
        run(tiny_model, TraceRequest(token_ids=IDS), hooks=hooks)


def test_patching_a_clean_runs_stream_at_one_position_changes_nothing_before_it(tiny_model):
    clean = trace_tokens(tiny_model, IDS, record="all")
    corrupt = trace_tokens(tiny_model, OTHER, record="all")
    values = {"layers.1.resid_post": clean["layers.1.resid_post"]}
    patched = trace_tokens(tiny_model, OTHER, record="all", interventions=[PatchAt(values, (8, 9))])
    for name in positional(corrupt):
        assert torch.equal(rows_before(patched, name, 8), rows_before(corrupt, name, 8)), name
    assert torch.equal(patched["layers.1.resid_post"][8], clean["layers.1.resid_post"][8])
    assert torch.equal(patched["layers.1.resid_post"][9:], corrupt["layers.1.resid_post"][9:])


def test_patching_every_position_of_the_last_stream_restores_the_clean_logits(tiny_model):
    clean = trace_tokens(tiny_model, IDS)
    last = f"layers.{TINY.n_layers - 1}.resid_post"
    values = {last: clean[last]}
    patched = trace_tokens(tiny_model, OTHER, interventions=[PatchAt(values, (len(IDS) - 1, None))])
    assert torch.equal(patched["logits.last"], clean["logits.last"])


def test_patch_from_a_trace_at_positions_from_the_command_line(tiny_checkpoint, tmp_path, capsys):
    ckpt = ["run", "--checkpoint", str(tiny_checkpoint), "--record", "all"]
    clean, corrupt, patched = (tmp_path / f"{n}.safetensors" for n in ("clean", "corrupt", "patched"))
    assert main([*ckpt, "--token-ids", ",".join(map(str, IDS)), "--out", str(clean)]) == 0
    assert main([*ckpt, "--token-ids", ",".join(map(str, OTHER)), "--out", str(corrupt)]) == 0
    other = ["--token-ids", ",".join(map(str, OTHER))]
    argv = [*ckpt, *other, "--patch-from", str(clean), "--sites", "layers.0.resid_post", "--positions", "7:9"]
    assert main([*argv, "--out", str(patched)]) == 0
    a, b, c = (Trace.load(p) for p in (clean, corrupt, patched))
    assert torch.equal(c["layers.0.resid_post"][7:9], a["layers.0.resid_post"][7:9])
    assert torch.equal(c["layers.0.resid_post"][:7], b["layers.0.resid_post"][:7])
    assert c.extra["interventions"] == ["patched layers.0.resid_post at positions 7:9"]
    for bad, message in (
        (["--patch-from", str(clean)], "--sites"),
        (["--sites", "layers.0.resid_post"], "--sites applies to --patch-from"),
        (["--positions", "3"], "--positions applies to"),
        (["--patch-from", str(clean), "--sites", "layers.0.attn.indexer.recall"], "can patch"),
    ):
        assert main([*ckpt, *other, *bad, "--out", str(tmp_path / "x.safetensors")]) == 2
        assert message in capsys.readouterr().err


def test_trace_tables_is_there_as_documented(base):
    tables = base.tables()
    assert {"tokens", "residual", "router"} <= set(tables) and len(tables["tokens"]) == len(IDS)


def test_a_loaded_checkpoint_runs_one_prompt_or_several(app_checkpoint):
    from tracing import load

    loaded = load(app_checkpoint)
    one = loaded.run("It is a truth", record="logits.last")
    two = loaded.run(["It is a truth", "It is a lie"], record="logits.last")
    assert isinstance(one, Trace) and [t.prompt for t in two] == ["It is a truth", "It is a lie"]
    assert torch.equal(two[0]["logits.last"], one["logits.last"]) and not torch.equal(two[1]["tokens"], one["tokens"])
