"""Weight tiers: a streamed model keeps what its budgets hold across passes, gives the resident
model's values whatever the budgets, never holds more than a budget, and every byte of a pass is
accounted for (disk, host tier, device tier)."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import SafetensorsSource, build_model, load_model
from model.stream import Streamer, held_bytes, stream_forward
from model.tiers import Tiers
from tracing.cli.loading import DEMO
from tracing.runner import trace_tokens


def stored_total(stats) -> int:
    return stats.bytes_read + stats.host_bytes + stats.device_hit_bytes


def held_of(source) -> int:
    return held_bytes(build_model(source.args), "cuda")  # the weights as the model holds them, no CPU copies


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    source = SafetensorsSource(tiny_checkpoint)
    return source, load_model(source)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_every_device_budget_gives_the_resident_logits_and_a_repeat_reads_what_the_tiers_left_out(tiny, tokens, share):
    source, resident = tiny
    with torch.inference_mode():
        want = resident(tokens, all_logits=True)
    whole = held_of(source)
    tiers = Tiers("cpu", int(share * whole), whole // 4 if share == 0.5 else 0)
    model = build_model(source.args)
    first_logits, first = stream_forward(model, source, tokens, "cpu", all_logits=True, tiers=tiers)
    device, host = tiers.device_tier.stored_bytes(), tiers.host_tier.stored_bytes()
    second_logits, second = stream_forward(model, source, tokens, "cpu", all_logits=True, tiers=tiers)
    assert torch.equal(first_logits, want) and torch.equal(second_logits, want)
    assert first.host_bytes == first.device_hit_bytes == 0 and stored_total(first) == stored_total(second)
    # the second request finds on the device and the host exactly what the first left there, reads the rest
    assert (second.device_hit_bytes, second.host_bytes) == (device, host)
    assert second.bytes_read == first.bytes_read - device - host
    if share == 1.0:
        assert second.bytes_read == 0 and second.device_hit_bytes == first.bytes_read
    elif share == 0.5:
        assert 0 < second.bytes_read < first.bytes_read and host > 0 and device > 0
        non_experts = [n for n in tiers.device_tier.names() if ".experts." not in n]
        assert {"embed", "head", "layers.0", "layers.2"} <= set(non_experts)  # the rest of the model first
    else:
        assert second.bytes_read == first.bytes_read and len(tiers.device_tier) == len(tiers.host_tier) == 0
    for tier in (tiers.device_tier, tiers.host_tier):
        assert tier.peak <= tier.budget  # never more than a budget, measured at each admission
    assert all(p.is_meta for p in model.parameters())


def test_a_host_tier_serves_a_repeat_by_copies_and_budgets_are_never_exceeded(tiny, tokens):
    source, resident = tiny
    with torch.inference_mode():
        want = resident(tokens)
    model = build_model(source.args)
    everything = Tiers("cpu", 0, 2 * held_of(source))
    _, first = stream_forward(model, source, tokens, "cpu", tiers=everything)
    logits, second = stream_forward(model, source, tokens, "cpu", tiers=everything)
    assert torch.equal(logits, want)
    assert second.bytes_read == 0 and second.host_bytes == first.bytes_read and second.device_hit_bytes == 0
    # a small device tier under pressure: experts displaced to the host, each tier within its budget
    expert = source.nbytes([n for n in source.specs() if ".experts.0." in n and ".layers.1." in n])
    tight = Tiers("cpu", held_of(source) // 3, 7 * expert)
    for _ in range(2):
        logits, _ = stream_forward(model, source, tokens, "cpu", tiers=tight)
        assert torch.equal(logits, want)
    assert 0 < tight.device_tier.peak <= tight.device_tier.budget and 0 < tight.host_tier.peak <= tight.host_tier.budget
    assert tight.host_tier.held <= 7 * expert


def test_a_generation_reads_each_unit_once_and_a_decode_step_only_the_experts_no_tier_holds(tiny, tokens):
    source, resident = tiny
    ids = tokens[0, :5].tolist()
    model = build_model(source.args)
    tiers = Tiers("cpu", held_of(source), 0)
    streamer = Streamer(model, source, tiers=tiers)
    got = trace_tokens(model, ids, generate=4, context=streamer)
    want = trace_tokens(resident, ids, generate=4)
    assert got.token_ids == want.token_ids and all(torch.equal(got.tensors[n], v) for n, v in want.tensors.items())
    assert set(streamer.stats.reads.values()) == {1}  # prefill and 4 decode steps: nothing read twice

    # half the model on the device: one decode step reads the units it runs that no tier holds
    small = Tiers("cpu", held_of(source) // 2, 0)
    cache = model.new_cache()
    with Streamer(model, source, tiers=small), torch.inference_mode():
        model(torch.tensor([ids]), cache=cache)
    held = set(small.device_tier.names())
    picked = {}
    handles = []
    for i in (1, 2):
        hook = model.layers[i].ffn.gate.topk_indices.register_forward_hook
        handles.append(hook(lambda m, a, out, i=i: picked.update({i: out.flatten().tolist()})))
    with Streamer(model, source, tiers=small) as step, torch.inference_mode():
        model(torch.tensor([[ids[-1]]]), start_pos=len(ids), cache=cache)
    for h in handles:
        h.remove()
    ran = {"embed", "norm", "head", *(f"layers.{i}" for i in range(3))}
    ran |= {f"layers.{i}.ffn.experts.{j}" for i, js in picked.items() for j in js}
    read = {u for u, s in step.stats.units.items() if s.bytes} | {
        f"layers.{n.split('.')[2]}.ffn.experts.{n.split('.')[5]}" for n in step.stats.reads if ".experts." in n
    }
    want_read = ran - held
    assert any(".experts." in n for n in ran & held) and any(".experts." in n for n in want_read)  # both kinds met
    assert {n for n in read if ".experts." in n} == {n for n in want_read if ".experts." in n}
    assert step.stats.device_hit_bytes == sum(small.device_tier._entries[n].stored for n in ran & held)
    assert 0 < step.stats.bytes_read


def test_the_demo_streamed_with_tiers_gives_the_resident_trace(tokens):
    if not (DEMO / "config.json").exists():
        pytest.skip("assets/demo is absent")
    source = SafetensorsSource(DEMO)
    ids = tokens[0, :6].tolist()
    want = trace_tokens(load_model(source), ids, generate=2)
    model = build_model(source.args, mtp=True)
    tiers = Tiers("cpu", held_bytes(model, "cuda") // 2, held_bytes(model, "cuda") // 4)
    for _ in range(2):
        streamer = Streamer(model, source, tiers=tiers)
        got = trace_tokens(model, ids, generate=2, context=streamer)
        assert got.token_ids == want.token_ids and all(torch.equal(got.tensors[n], v) for n, v in want.tensors.items())
    assert streamer.stats.device_hit_bytes > 0 and streamer.stats.host_bytes > 0
    assert tiers.device_tier.peak <= tiers.device_tier.budget and tiers.host_tier.peak <= tiers.host_tier.budget


def test_the_budgets_are_flags_of_every_command_and_a_served_stream_keeps_them_across_requests(tiny_checkpoint, capsys):
    from tests.tracing.serving import in_process, post
    from tracing.cli.commands import main
    from tracing.client import read_answer
    from tracing.runner import TraceRequest
    from tracing.trace import Trace

    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2", "--out", "x.safetensors", "--stream"]
    assert main([*argv, "--device-budget", "lots"]) == 2
    assert "--device-budget 'lots': give auto, 0 or an amount of memory" in capsys.readouterr().err
    remote = ["run", "--server", "http://127.0.0.1:9", "--token-ids", "1,2", "--out", "x.safetensors"]
    assert main([*remote, "--host-budget", "1GiB"]) == 2
    assert "--host-budget: the server's model runs as it was started" in capsys.readouterr().err

    request = TraceRequest(token_ids=[5, 17, 300, 2], generate=2)
    with in_process(str(tiny_checkpoint), stream=True, budgets=(10 * 2**30, 0)) as (client, state, loaded):
        traces = []
        for _ in range(2):
            answer = post(client, request)
            assert answer.status_code == 200, answer.text
            traces.append(Trace.from_bytes(read_answer(iter([answer.content]))))
        health = client.get("/health").json()
    first, second = (t.extra["stream"] for t in traces)
    assert first["disk_bytes"] > 0 and first["device_hit_bytes"] > 0  # the decode steps ran on what the prefill read
    assert second["disk_bytes"] == 0 and second["device_hit_bytes"] == first["disk_bytes"] + first["device_hit_bytes"]
    assert health["streamed"] == {k: first[k] + second[k] for k in ("disk_bytes", "host_bytes", "device_hit_bytes")}
    assert loaded.tiers.device_tier.peak <= loaded.tiers.device_tier.budget


def test_the_default_budgets_leave_a_request_and_units_in_flight_and_share_the_host(tiny_checkpoint, monkeypatch):
    import tracing.plan as plan

    source, cpu = SafetensorsSource(tiny_checkpoint), torch.device("cpu")
    part = plan.plan_rank(source, device="cpu", weights_only=True)
    counted = plan.RankPlan(0, part.weights, 4000, 3000, 2000, 1000, part.disk)  # a request's plan: caches, activations...
    load = plan.Load(True, part.weights, counted.request, 0, part.disk, 1, 16, counted=counted)
    free = counted.request + 3 * plan._largest_unit(source) + part.weights // 2  # the device tier gets half the weights
    monkeypatch.setattr(plan, "available_memory", lambda device="cpu": free)
    assert plan.tier_budgets(source, cpu, load=load) == (part.weights // 2, 0)  # the host's reserve takes the rest
    free = plan.HOST_RESERVE + part.disk  # the reserve left, the host tier holds every stored byte
    assert plan.tier_budgets(source, cpu, device_budget=0) == (0, part.disk)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on the node: each gets half
    assert plan.tier_budgets(source, cpu, device_budget=0) == (0, part.disk // 2)
    assert plan.tier_budgets(source, cpu, device_budget=10**15, host_budget=10**15) == (part.weights, part.disk)  # capped
