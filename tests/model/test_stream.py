"""Streaming: block by block gives what the loaded model gives, reads only the picked experts,
keeps about two blocks resident, and leaves the model on the meta device."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model import TINY
from model.checkpoint import SafetensorsSource, TensorReader, WeightSource, build_model, has_mtp, load_model
from model.hooks import HookPoint
from model.stream import Streamer, held_bytes, model_bytes, stream_forward
from model.synthetic import SyntheticSource, synthetic_source
from tests.model.test_mtp import IDS, MTP_ARGS, mtp_checkpoint
from tracing.analyses.mtp import NOTE_SKIPPED
from tracing.cli.commands import main
from tracing.runner import trace_tokens
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[2]
GPU_CHECK = REPO / "scripts" / "gpu_check.py"


class CountingSource(WeightSource):
    """Delegates to another source and counts each tensor read."""

    def __init__(self, inner: WeightSource):
        self.inner, self.args, self.reads = inner, inner.args, {}

    def specs(self):
        return self.inner.specs()

    def load(self, name, device="cpu"):
        self.reads[name] = self.reads.get(name, 0) + 1
        return self.inner.load(name, device)


def every_hook_point(model) -> dict[str, list[torch.Tensor]]:
    """Record every hook point's value; returns (store, handles)."""
    store, handles = {}, []
    for name, module in model.named_modules():
        if isinstance(module, HookPoint):

            def hook(m, i, out, name=name):
                store.setdefault(name, []).append(out.detach().clone())

            handles.append(module.register_forward_hook(hook))
    return store, handles


def run_loaded(model, tokens, **kw):
    store, handles = every_hook_point(model)
    with torch.inference_mode():
        logits = model(tokens, **kw)
    for h in handles:
        h.remove()
    return logits, store


def run_streamed(source, tokens, **kw):
    model = build_model(source.args)
    store, handles = every_hook_point(model)
    all_logits = kw.pop("all_logits", False)
    logits, stats = stream_forward(model, source, tokens, "cpu", all_logits=all_logits, **kw)
    for h in handles:
        h.remove()
    return logits, store, stats, model


@pytest.mark.parametrize("prefetch", [True, False])
def test_streaming_gives_the_logits_and_hook_values_of_the_loaded_model(tiny_checkpoint, tokens, prefetch):
    source = SafetensorsSource(tiny_checkpoint)
    want, want_store = run_loaded(load_model(source), tokens, all_logits=True)
    got, got_store, stats, model = run_streamed(source, tokens, all_logits=True, prefetch=prefetch)
    assert torch.equal(got, want)
    assert sorted(got_store) == sorted(want_store) and len(got_store) >= 48
    for name, values in want_store.items():
        assert len(got_store[name]) == len(values), name
        assert all(torch.equal(a, b) for a, b in zip(got_store[name], values, strict=True)), name
    assert all(p.is_meta for p in model.parameters())  # everything freed afterwards
    assert stats.bytes_read == sum(stats.units[u].bytes for u in stats.units)


def test_streaming_a_synthetic_source_and_reading_shards_directly_agree(tiny_source, tiny_model, tiny_checkpoint, tokens):
    want, _ = run_loaded(tiny_model, tokens)
    got, _, _, _ = run_streamed(tiny_source, tokens)
    assert torch.equal(got, want)
    # the direct shard reader returns what safetensors returns, whole or by rows
    from model.parallel import Part

    source = SafetensorsSource(tiny_checkpoint)
    reader = TensorReader(source)
    for name in source.specs():
        assert torch.equal(reader.read(name, "cpu").view(torch.uint8), source.load(name).view(torch.uint8)), name
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    part = reader.read(name, "cpu", Part(0, 64, 192)).view(torch.uint8)
    assert torch.equal(part, source.load(name)[64:192].view(torch.uint8))
    reader.close()
    # through a staging buffer (the GPU path: a reused page-locked buffer), here forced on the CPU
    staged = TensorReader(source, staging_bytes=1000, staging=True)  # many chunks per tensor
    for name in source.specs():
        assert torch.equal(staged.read(name, "cpu").view(torch.uint8), source.load(name).view(torch.uint8)), name
    part = staged.read("model.layers.1.self_attn.kv_b_proj.weight", "cpu", Part(0, 64, 192)).view(torch.uint8)
    assert torch.equal(part, source.load("model.layers.1.self_attn.kv_b_proj.weight")[64:192].view(torch.uint8))
    staged.close()


def test_only_the_picked_experts_are_read_once_each(tiny_source, tokens):
    tokens = tokens[:, :3]  # 3 tokens pick at most 12 of the 16 experts of a block
    source = CountingSource(tiny_source)
    model = build_model(TINY)
    picked = {}
    for i in (1, 2):

        def hook(m, inp, out, i=i):
            picked[i] = set(out.flatten().tolist())

        model.layers[i].ffn.gate.topk_indices.register_forward_hook(hook)
    stream_forward(model, source, tokens, "cpu")
    assert set(source.reads.values()) == {1}  # nothing read twice
    experts = {n for n in source.reads if ".experts." in n}
    expected = {n for n in source.specs() if ".experts." in n and int(n.split(".")[5]) in picked[int(n.split(".")[2])]}
    assert experts == expected and 0 < len(expected) < sum(".experts." in n for n in source.specs())
    assert {n for n in source.reads if ".experts." not in n} == {n for n in source.specs() if ".experts." not in n}


def test_resident_weights_stay_within_two_blocks(tiny_source, tokens):
    _, _, ahead, _ = run_streamed(tiny_source, tokens, prefetch=True, expert_window=2)
    _, _, sync, _ = run_streamed(tiny_source, tokens, prefetch=False)
    block = max(u.bytes for u in sync.units.values())  # the most read for one step (a block and its experts)
    # without read-ahead at most one step's weights are resident (experts come and go one by one);
    # with it, the next step and a window of experts as well
    assert tiny_source.nbytes(["lm_head.weight"]) <= sync.peak_resident_bytes <= block
    assert ahead.peak_resident_bytes <= 2 * block < ahead.bytes_read
    assert ahead.bytes_read == sync.bytes_read


def test_progress_reports_every_block_with_bytes_and_the_model_is_freed_after_an_error(tiny_source, tokens):
    events = []
    run_streamed(tiny_source, tokens, progress=events.append)
    assert [e.name for e in events] == ["embed", "layers.0", "layers.1", "layers.2", "head"]
    assert [e.step for e in events] == [1, 2, 3, 4, 5] and events[-1].total == 5
    assert all(a.bytes_read <= b.bytes_read for a, b in zip(events, events[1:], strict=False))
    assert events[2].unit.experts > 0 and events[1].unit.experts == 0  # layer 1 is MoE, layer 0 dense

    model = build_model(TINY)

    def boom(m, i, o):
        raise RuntimeError("boom")

    model.layers[1].ffn.gate.scores.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        stream_forward(model, tiny_source, tokens, "cpu")
    assert all(p.is_meta for p in model.parameters())
    assert not any(m._forward_pre_hooks for m in model.modules())  # the streamer's hooks are gone


def test_streaming_needs_a_meta_model_and_names_a_missing_tensor(tiny_model, tiny_checkpoint, tmp_path, tokens):
    with pytest.raises(ValueError, match="meta device"):
        with Streamer(tiny_model, SyntheticSource(TINY)):
            pass
    bad = SyntheticSource(TINY.replace(n_layers=2))  # has no layers.2
    model = build_model(TINY)
    with pytest.raises(Exception, match=r"model\.layers\.2\.\S+ .* is missing"):
        stream_forward(model, bad, tokens, "cpu")


def test_model_bytes_counts_the_weights_as_held(tiny_source):
    real = synthetic_source(REPO / "assets/configs/config_671B_hf.json", n_layers=4)  # 17 GB, 19 GB held (float32 head)
    fp8_bytes = model_bytes(real, "cuda")
    assert 18e9 < fp8_bytes < 20e9
    assert model_bytes(real, "cpu") > 3 * fp8_bytes  # plus the float32 copies Linear keeps on the CPU
    for device in ("cpu", "cuda"):  # the built model's own parameters and buffers say the same
        assert held_bytes(build_model(real.args, mtp=has_mtp(real)), device) == model_bytes(real, device)
    fp8 = [s for s in tiny_source.specs().values() if s.dtype == torch.float8_e4m3fn]
    assert model_bytes(tiny_source, "cpu") == model_bytes(tiny_source, "cuda") + 4 * sum(s.shape[0] * s.shape[1] for s in fp8)


def gpu_check(tmp_path, *flags: str) -> tuple[int, dict, str]:
    """scripts/gpu_check.py on the CPU, on TINY: (exit status, its JSON file, its table)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY.to_hf()))
    out = tmp_path / "gpu_check.json"
    argv = [sys.executable, str(GPU_CHECK), "--device", "cpu", "--config", str(config), "--out", str(out)]
    argv += ["--workdir", str(tmp_path / "work"), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
    return done.returncode, json.loads(out.read_text()), done.stdout


@pytest.mark.slow  # about 50 s on two shared cores: five phases, each a few processes of `python -m tracing`
def test_gpu_check_runs_every_phase_on_the_cpu(tmp_path):
    code, summary, table = gpu_check(tmp_path, "--tokens", "12", "--generate", "2", "--compare-tokens", "6")
    phases = {p["name"]: p for p in summary["phases"]}
    assert code == 0 and summary["ok"], json.dumps(summary, indent=1)[-4000:]
    assert list(phases) == ["disk", "run", "server", "plan", "kernels", "tiers", "cpu_compare"]
    assert all(name in table for name in phases) and "ok in" in table
    disk = phases["disk"]
    assert disk["blocks"] == 3 and disk["bytes"] > 0 and disk["write_gbps"] > 0 and disk["read_gbps"] > 0
    same = phases["run"]["resident_vs_stream"]  # indexer of 3 blocks, experts of 2, the MTP module's: 6 positions each
    assert same["sites"] >= 5 and same["rows"] == 6 * same["sites"] and same["rows_differing"] == 0
    server = phases["server"]
    assert 400 <= server["bad"]["status"] < 500 and "temperature" in server["bad"]["error"]
    assert server["rank_fault"]["status"] == 500 and "injected fault" in server["rank_fault"]["error"]
    assert server["good_after_fault"]["generated"] == 2 and server["long"]["generated"] == 2  # serving on after it
    assert server["stopped_cleanly"] and "held in memory" in server["load"]
    plan = phases["plan"]
    assert plan["plan_load"] == "resident" and 0.8 <= plan["predicted_over_measured"] <= 1.2
    assert phases["kernels"]["products_equal_share"] == 1.0 and "not on the CPU" in phases["kernels"]["forward"]
    tiers = phases["tiers"]  # the whole tiny model in the device budget: the second request reads nothing
    assert tiers["second"]["disk_bytes"] == 0 < tiers["first"]["disk_bytes"] and tiers["decode"]["expert_hit_rate"] is not None
    assert phases["cpu_compare"]["cpu_resident_vs_cpu"]["rows_differing"] == 0  # the CPU against itself
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())  # the checkpoint removed


def test_gpu_check_skips_what_its_budget_cannot_hold_and_says_so(tmp_path):
    code, summary, table = gpu_check(tmp_path, "--budget-s", "20")
    assert code == 1 and not summary["ok"]
    assert [(p["name"], p["status"]) for p in summary["phases"]] == [
        (name, "skipped") for name in ("disk", "run", "server", "plan", "kernels", "tiers", "cpu_compare")
    ]
    assert "no time left" in summary["phases"][0]["reason"] and "needs checkpoint" in summary["phases"][1]["reason"]
    assert "FAILED" in table and "skipped" in table


@pytest.mark.slow
def test_real_width_first_four_blocks_stream_in_bounded_memory(tmp_path):
    """Hidden 7168, the first 4 blocks of the 671B config (3 dense, 1 MoE), 8 tokens, streamed on this CPU."""
    out, peak = tmp_path / "trace.safetensors", tmp_path / "peak_kib"
    # `python -m tracing run ...`, then the process's own peak (VmHWM, KiB) written as it ends: the
    # worker's RUSAGE_CHILDREN holds the largest child it ever waited for, and ru_maxrss carries
    # the forking worker's peak across exec
    wrapper = (
        "import runpy, sys\n"
        "try:\n    runpy.run_module('tracing', run_name='__main__', alter_sys=True)\n"
        "finally:\n"
        "    status = open('/proc/self/status').read().splitlines()\n"
        f"    open({str(peak)!r}, 'w').write(next(l for l in status if l.startswith('VmHWM')).split()[1])\n"
    )
    argv = [sys.executable, "-c", wrapper, "run", "--synthetic", str(REPO / "assets" / "configs" / "config_671B_hf.json")]
    argv += ["--n-layers", "4", "--stream", "--token-ids", "1,2,3,4,5,6,7,8", "--out", str(out)]
    argv += ["--device-budget", "0", "--host-budget", "0"]  # the stream's own bound, nothing kept between passes
    done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(peak.read_text()) * 1024 < 8 * 2**30
    trace = Trace.load(out)
    assert trace["layers.3.ffn.gate.topk_indices"].shape == (8, 8)  # layer 3 is MoE: its picked experts were read


def test_replay_reads_what_a_forward_reads_without_computing(tiny_source, tokens):
    _, _, stats, _ = run_streamed(tiny_source, tokens[:, :3])
    picked = {}
    for name in stats.reads:
        if ".experts." in name:
            picked.setdefault(int(name.split(".")[2]), set()).add(int(name.split(".")[5]))
    model = build_model(TINY)
    with Streamer(model, tiny_source) as streamer:
        streamer.replay({i: sorted(js) for i, js in picked.items()})
    assert streamer.stats.reads == stats.reads and streamer.stats.bytes_read == stats.bytes_read
    assert all(p.is_meta for p in model.parameters())


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp")


def test_the_mtp_module_streams_like_a_block_and_traces_as_one_process(mtp_dir):
    """Its sites recorded, the MTP module is one more step after the head (its picked experts
    only, the embedding read again, the head kept): the trace is the loaded model's byte for byte,
    prefill and generation; unrecorded, not one of its tensors is read."""
    source, n = SafetensorsSource(mtp_dir), MTP_ARGS.n_layers
    loaded, model = load_model(source), build_model(source.args, mtp=True)
    picked = set()
    model.mtp[0].block.ffn.gate.topk_indices.register_forward_hook(lambda m, i, out: picked.update(out.flatten().tolist()))
    for request in ({"record": "all"}, {"generate": 5}):
        ids = IDS[:3] if "record" in request else IDS[:4]  # 3 positions pick at most 12 of the 16 experts
        want = trace_tokens(loaded, ids, **request)
        events = []
        streamer = Streamer(model, source, progress=events.append)
        got = trace_tokens(model, ids, context=streamer, **request)
        assert {"mtp.topk_indices", "mtp.topk_probs"} <= set(got.tensors) and set(got.tensors) == set(want.tensors)
        for name, value in want.tensors.items():
            assert torch.equal(got.tensors[name], value), name
        assert got.token_ids == want.token_ids and all(p.is_meta for p in model.parameters())
        if "record" in request:  # one pass: each of the MTP block's picked experts read once, no other
            experts = f"model.layers.{n}.mlp.experts."
            read = {int(k.split(".")[5]): v for k, v in streamer.stats.reads.items() if k.startswith(experts)}
            assert set(read) == picked and set(read.values()) == {1} and len(picked) < MTP_ARGS.n_routed_experts
            assert streamer.stats.reads["model.embed_tokens.weight"] == 2 and streamer.stats.reads["lm_head.weight"] == 1
            assert streamer.stats.units["mtp.0"].experts == len(picked)
            assert [e.name for e in events[-2:]] == ["head", "mtp.0"] and events[-1].step == events[-1].total == n + 3
    assert got.extra["generation"]["mtp_acceptance"] == want.extra["generation"]["mtp_acceptance"]
    plain = Streamer(model, source, progress=events.append)
    events.clear()
    trace_tokens(model, IDS, record="layers.*,logits.*,next.*", context=plain)
    assert not any(name.startswith(f"model.layers.{n}.") for name in plain.stats.reads)
    assert events[-1].name == "head" and events[-1].total == n + 2
    with Streamer(model, source), torch.inference_mode():  # asked for in Python, as in one process
        got = model(torch.tensor([IDS]), mtp=True)
        want = loaded(torch.tensor([IDS]), mtp=True)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_streaming_from_the_command_line_drafts_unless_no_mtp(mtp_dir, tmp_path):
    streamed, whole, bare = (tmp_path / f"{k}.safetensors" for k in ("streamed", "whole", "bare"))
    argv = ["run", "--checkpoint", str(mtp_dir), "--token-ids", "5,17,300,2,9", "--generate", "3"]
    assert main([*argv, "--stream", "--out", str(streamed)]) == 0 and main([*argv, "--out", str(whole)]) == 0
    a, b = Trace.load(streamed), Trace.load(whole)
    assert "mtp.topk_indices" in a.tensors and "mtp" not in a.extra and set(a.tensors) == set(b.tensors)
    assert all(torch.equal(a.tensors[name], value) for name, value in b.tensors.items())
    assert main([*argv, "--stream", "--no-mtp", "--out", str(bare)]) == 0
    c = Trace.load(bare)
    assert not any(name.startswith("mtp.") for name in c.tensors) and c.extra["mtp"] == NOTE_SKIPPED
