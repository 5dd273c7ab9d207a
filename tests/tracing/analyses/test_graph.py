"""Intervention graphs (tracing.analyses.graph): the JSON form and its checks, what a graph does to a
run (in the prefill and at every decode step), the shipped examples, the command line. The examples
through a server are checked in tests/tracing/test_server.py, on its shared server."""

from __future__ import annotations

import json

import pytest
import torch

from scripts import graph_examples
from tracing.analyses.graph import MAX_OPS, Graph, check_graph
from tracing.cli.commands import main
from tracing.cli.loading import REPO, open_checkpoint
from tracing.client import Client
from tracing.errors import InputError

PROMPT = "It is a truth universally acknowledged"
EXAMPLES = REPO / "docs" / "examples"


@pytest.fixture(scope="module")
def demo(app_checkpoint):
    return open_checkpoint(app_checkpoint)


def test_the_builder_reads_like_nnsight_and_its_json_goes_round():
    g = Graph()
    x = g.read("layers.2.resid_post", positions=[-1])
    d = g.constant(torch.ones(8), name="d")
    g.add("layers.3.resid_pre", (x * 4.0).project_out(d) - 1.0, positions="3:")
    g.replace("layers.1.attn.head_out", g.read("layers.1.attn.head_out", heads=[2]).mean(), heads=[2])
    g.save("n", x.norm().clamp(max=10.0))
    again = Graph.from_json(g.to_json(), g.tensors)
    assert again.to_dict() == g.to_dict() and json.loads(g.to_json())["ops"][0]["positions"] == [-1]
    assert [op["op"] for op in g.ops][:5] == ["read", "const", "scale", "project_out", "sub"]


@pytest.mark.parametrize(
    "ops, words",
    [
        ([{"op": "explode"}], "unknown op 'explode'"),
        (
            [{"op": "read", "id": "x", "site": "layers.0.resid_pre"}, {"op": "save", "name": "s", "value": "y"}],
            "use after define",
        ),
        ([{"op": "read", "id": "x", "site": "layers.0.nothing"}], "not a hook point"),
        ([{"op": "read", "id": "x", "site": "layers.0.attn.indexer.recall"}], "not a hook point"),
        ([{"op": "read", "id": "x", "site": "layers.0.resid_pre", "positions": "a:b"}], "expected P, A:B"),
        ([{"op": "const", "id": "c", "value": [[1, 2], [3]]}], "rectangular"),
        ([{"op": "const", "id": "c", "value": 1, "x": "c"}], "unknown field 'x'"),
        (
            [{"op": "const", "id": "c", "value": 1}, {"op": "write", "site": "layers.1.ffn.gate.topk_indices", "value": "c"}],
            "integers",
        ),
        (
            [{"op": "const", "id": "c", "value": 1}, {"op": "write", "site": "layers.1.resid_pre", "value": "c", "mode": "mix"}],
            "mode",
        ),
        ([{"op": "const", "id": "c", "value": 1}, {"op": "const", "id": "c", "value": 2}], "used twice"),
        ([{"op": "const", "id": "c", "value": 1}], "writes and saves nothing"),
        ([{"op": "read", "id": "x", "site": "mtp.0.logits"}], "outside a graph's reach"),
        ([{"op": "const", "id": f"c{i}", "value": 1} for i in range(MAX_OPS + 1)], f"at most {MAX_OPS}"),
    ],
)
def test_a_malformed_graph_is_one_line_before_any_model(ops, words):
    with pytest.raises(InputError, match=words) as caught:
        Graph.from_dict({"graph": 1, "ops": ops}).check()
    assert "\n" not in str(caught.value)


def test_nan_constants_and_oversized_tensors_are_refused():
    with pytest.raises(InputError, match="not JSON"):
        Graph.from_json('{"graph": 1, "ops": [{"op": "const", "id": "c", "value": NaN}]}')
    with pytest.raises(InputError, match="NaN"):
        Graph().constant(torch.tensor([1.0, float("nan")]))
    with pytest.raises(InputError, match="MiB"):
        Graph().constant(torch.zeros(1 << 25, dtype=torch.float16))
    with pytest.raises(InputError, match="used by no operation"):
        Graph.from_dict({"graph": 1, "ops": []}, {"stray": torch.ones(2)})


def test_shapes_sites_and_positions_are_checked_against_the_model_before_it_runs(demo):
    args = demo.model.args

    def checked(build) -> str:
        g = Graph()
        build(g)
        with pytest.raises(InputError) as caught:
            check_graph(g, args, 6, generate=2)
        return str(caught.value)

    assert "shape [3]" in checked(lambda g: g.add("layers.1.resid_pre", g.constant([1.0, 2.0, 3.0])))
    assert "no site" in checked(lambda g: g.add(f"layers.{args.n_layers}.resid_pre", g.constant(1.0)))
    assert "heads are numbered" in checked(lambda g: g.save("h", g.read("layers.1.attn.head_out", heads=[args.n_heads])))
    assert "outside the run's 0..7" in checked(lambda g: g.add("layers.1.resid_pre", g.constant(1.0), positions=[8]))
    assert "last axis" in checked(lambda g: g.save("p", g.read("layers.1.resid_pre").project(g.constant([1.0, 0.0]))))
    # two rows fit the prefill's positions 4 and 5, not a decode step's 4..6: refused before the run
    two = checked(lambda g: g.add("layers.2.resid_pre", g.read("layers.1.resid_post", positions="0:2"), positions="4:"))
    assert f"[3, {args.dim}] (3 positions)" in two
    assert "constants alone" in checked(lambda g: g.save("c", g.constant(1.0)))
    outer = checked(lambda g: g.save("o", g.read("layers.1.resid_post") * g.constant(torch.ones(4096, 1, 1))))
    assert "a broadcast across two position axes" in outer
    late = Graph()
    late.add("layers.1.resid_pre", late.read("layers.2.resid_pre"))
    with pytest.raises(InputError, match="computes later"):
        demo.run(PROMPT, graph=late)


def test_a_read_at_the_newest_position_follows_each_decode_step(demo):
    g = Graph()
    x = g.read("layers.1.resid_post", positions=[-1])
    g.save("newest", x)
    g.save("first_two", g.read("layers.1.resid_post", positions=":2"))
    g.save("logits", g.read("logits.last"))  # no position axis: the newest position's, one row a pass
    trace = demo.run(PROMPT, generate=3, graph=g, record="layers.1.resid_post,logits.last")
    start = trace.extra["generation"]["start"]
    resid = trace["layers.1.resid_post"]
    assert torch.equal(trace["graph.newest"], resid[start - 1 :])  # the prefill's last, then each step's own
    assert torch.equal(trace["graph.first_two"], resid[:2].repeat(4, 1))  # absolute positions: the same two each pass
    assert torch.equal(trace["graph.logits"][-1], trace["logits.last"]) and len(trace["graph.logits"]) == 4
    assert trace.tables()["graph"].groupby("name")["row"].max().to_dict() == {"first_two": 7, "logits": 3, "newest": 3}


def test_the_steering_example_adds_its_direction_every_pass_and_is_what_the_script_makes(demo):
    shipped = Graph.load(EXAMPLES / "steering.json")
    made = graph_examples.steering(demo)
    assert made.to_dict() == shipped.to_dict()
    assert torch.allclose(made.tensors["direction"], shipped.tensors["direction"], atol=1e-3, rtol=1e-3)
    sites = [graph_examples.STEER_SITE, graph_examples.STEER_INTO]
    plain = demo.run(PROMPT, generate=4, record=sites)
    steered = demo.run(PROMPT, generate=4, record=sites, graph=shipped)
    added = steered[sites[1]] - steered[sites[0]]  # the same stream: what the graph added entering block 2
    want = graph_examples.STRENGTH * shipped.tensors["direction"]
    assert added[0].abs().max() == 0 and torch.allclose(added[1:], want.expand_as(added[1:]), atol=1e-4)
    assert steered.tokens[:-4] == plain.tokens[:-4] and steered.tokens != plain.tokens  # it writes other words
    assert steered.extra["graph"]["tensors"]["direction"]["shape"] == [demo.model.args.dim]
    assert steered.extra["graph"]["ops"] == shipped.to_dict()["ops"]


def test_the_mean_ablation_example_puts_the_mean_in_and_saves_it(demo):
    shipped = Graph.load(EXAMPLES / "mean_ablation.json")
    assert shipped.to_dict() == graph_examples.mean_ablation().to_dict()
    site = "layers.1.attn_out"
    plain = demo.run(PROMPT, record=site)
    trace = demo.run(PROMPT, generate=2, record=site, graph=shipped)
    start = trace.extra["generation"]["start"]
    mean = trace["graph.attn_out_mean"]  # (passes, D): the prefill's, then each step's over the positions so far
    assert mean.shape == (3, demo.model.args.dim)
    assert torch.allclose(mean[0], plain[site][1:].mean(0))  # the prefill reads the model's own values
    rounded = mean.to(demo.model.dtype).float()  # the model's update is in its activation dtype
    assert torch.equal(trace[site][1:start], rounded[0].expand(start - 1, -1))
    assert torch.equal(trace[site][start:], rounded[1:])  # each step writes its own mean
    assert torch.equal(trace[site][0], plain[site][0])  # BOS keeps its own


def test_a_bad_graph_file_is_one_line_and_status_2_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"graph": 1, "ops": [{"op": "read", "id": "x", "site": "layers.1.resid_pre", "positions": [1e3]}]}')
    argv = ["run", "--checkpoint", "no/such/checkpoint", "--prompt", PROMPT, "--out", str(tmp_path / "t.safetensors")]
    assert main([*argv, "--graph", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json: graph op 0 (read): positions are a list" in err[0]
    (tmp_path / "steer.json").write_text('{"graph": 1, "tensors": "steer.safetensors", "ops": []}')
    assert main([*argv, "--graph", str(tmp_path / "steer.json")]) == 2
    assert "steer.safetensors: cannot read the graph tensors file" in capsys.readouterr().err


def test_hooks_on_a_remote_model_point_to_a_graph():
    with pytest.raises(InputError, match="graph=") as caught:
        Client("http://127.0.0.1:9").trace(prompt=PROMPT, hooks={"layers.1.attn_out": lambda v, ctx: None})
    assert "\n" not in str(caught.value)


def test_writes_at_heads_and_experts_act_as_the_ready_made_removals(demo):
    """A head's output replaced by 0 is the head ablated (its probabilities zeroed); an expert's biased
    score pushed far down is the expert ablated (routed around): the same runs, bit for bit."""
    plain = demo.run(PROMPT)
    chosen = int(plain["layers.2.ffn.gate.topk_indices"][-1, 0])  # the last position's first expert in block 2
    heads = Graph()
    heads.replace("layers.1.attn.head_out", heads.constant(0.0), heads=[1])
    experts = Graph()
    experts.replace("layers.2.ffn.gate.biased_scores", experts.constant(-1e4), experts=[chosen])
    for graph, spec in ((heads, {"ablate_heads": "1:1"}), (experts, {"ablate": f"2:{chosen}"})):
        ours, theirs = demo.run(PROMPT, graph=graph), demo.run(PROMPT, interventions=spec)
        for name in ("layers.3.resid_post", "logits.last"):
            assert torch.equal(ours[name], theirs[name]), name
        assert not torch.equal(ours["logits.last"], plain["logits.last"])
