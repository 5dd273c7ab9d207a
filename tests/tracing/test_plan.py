"""The memory plan (tracing.plan, python -m tracing plan) and the load decision made from it.

The plan counts what a request allocates by running it on the meta device; here it is checked
against the same count over real tensors on the CPU (the demo, a mid-size synthetic model), and
the decision per rank on the 671B config split over 8 simulated ranks, with a patched free memory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from model import config, kernels
from model.checkpoint import SafetensorsSource, load_model
from model.config import ModelArgs
from model.synthetic import SyntheticSource
from tracing.cli.commands import main
from tracing.cli.loading import DEMO, open_checkpoint
from tracing.cli.serve import _facts
from tracing.plan import ConfigSource, count_run, decide_load, plan_rank
from tracing.server.wire import Limits

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "assets/configs/config_671B_hf.json"
MID = config.MID.replace(n_layers=3, n_routed_experts=32, index_topk=64)  # FP8 blocks of real width


@pytest.mark.parametrize(
    "source, tokens",
    [(SafetensorsSource(DEMO), 200), (SyntheticSource(MID), 64)],
    ids=["demo (4 blocks: two counted, extended by one)", "mid-size (FP8, real block width)"],
)
def test_the_plan_predicts_the_peak_a_real_cpu_run_allocates(source, tokens):
    predicted = plan_rank(source, tokens=tokens, device="cpu")
    model = load_model(source, "cpu")
    with kernels.plain():  # the products as a GPU forms them (the CPU backend's routes keep leaner buffers)
        measured = count_run(model, None, tokens, 0, ["default"], meta=False)
        bare = count_run(model, None, tokens, 0, ["logits.last"], meta=False)
    assert abs(predicted.peak - measured["peak"]) <= 0.2 * measured["peak"]
    assert abs(predicted.activations + predicted.caches - bare["peak"]) <= 0.2 * bare["peak"]
    assert predicted.trace == measured["trace"]  # the trace file's tensors, byte for byte
    assert predicted.caches == measured["caches"]


def test_each_of_8_ranks_decides_from_its_own_part_of_the_671b():
    source = ConfigSource(ModelArgs.from_file(REAL))  # the released checkpoint's tensors, MTP module included
    cuda = torch.device("cuda")  # counted, not used: nothing is allocated
    held = [decide_load(source, cuda, rank=r, world=8, tokens=4096, free=int(141e9)) for r in range(8)]
    for load in held:
        assert not load.stream
        assert 80e9 < load.weights < 90e9  # its eighth, not the whole 676 GB
        assert 0 < load.request < 141e9 - load.weights  # a 4,096-token request, counted
        assert load.line().startswith("model held in memory (its part, 88.0 GB per rank, and ")
        assert load.line().endswith("a request reads nothing from disk")
    streamed = [decide_load(source, cuda, rank=r, world=8, tokens=4096, free=int(80e9)) for r in range(8)]
    for load in streamed:
        assert load.stream and 80e9 < load.disk < 90e9
        assert load.line() == (
            "model streamed (its part, 88.0 GB per rank, exceeds the 80.0 GB free): every forward pass "
            "(the prefill and each generated token) reads 87.7 GB per rank from disk"
        )
    whole = decide_load(source, cuda, tokens=4096, free=int(141e9))  # one process: the whole model
    assert whole.stream and whole.weights > 600e9


def test_the_plan_command_for_a_node(capsys):
    code = main(["plan", "--config", str(REAL), "--ranks", "8", "--device-memory", "141GB", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert code == 0 and plan["load"] == "resident" and plan["fits"] is True
    assert len(plan["per_rank"]) == 8
    for rank in plan["per_rank"]:
        parts = ("weights_gb", "caches_gb", "activations_gb", "derived_gb")
        assert rank["total_gb"] == pytest.approx(sum(rank[k] for k in parts), abs=0.01)
        assert 80 < rank["weights_gb"] < 90 and rank["trace_gb"] > 0 and rank["total_gb"] < 141
    assert main(["plan", "--config", str(REAL), "--ranks", "8", "--device-memory", "80GB"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 + 8 + 1 and out[-1].startswith("stream: a rank's part (88.0 GB of weights)")
    assert "reads 701.6 GB from disk over the 8 ranks" in out[-1]


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--ranks", "0"], "--ranks"),
        (["--device-memory", "lots"], "not an amount of memory"),
        (["--tokens", "300"], "exceed the 256 positions"),
        (["--record", "layers.*.nothing"], "nothing"),
    ],
)
def test_the_plan_command_refuses_bad_input_in_one_line(capsys, argv, said):
    assert main(["plan", "--checkpoint", "demo", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1


def test_the_server_says_how_it_holds_the_model(tiny_checkpoint):
    loaded = open_checkpoint(tiny_checkpoint, stream=None, tokens=64)
    load = _facts(loaded, 1, Limits())["health"]["load"]
    assert load["load"] == "resident" and load["disk_gb_per_pass"] == 0.0
    assert load["line"].startswith("model held in memory (its part, ") and load["line"] == loaded.load.line()
    forced = open_checkpoint(tiny_checkpoint, stream=True)
    assert forced.load.line().startswith("model streamed (as asked (--stream)): every forward pass")
