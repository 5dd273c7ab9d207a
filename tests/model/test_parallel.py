"""Tensor and expert parallelism: 2 ranks with gloo give the trace of one process.

The ranks are two processes started as ``torchrun`` would start them (RANK, WORLD_SIZE,
MASTER_ADDR/PORT in the environment), running this file as a script; rank 0 writes what the
hook points saw to a safetensors file, which the tests compare with one process's values.

Tolerances: selections (experts, groups, indexer keys) must be identical. Float values may differ
by float32 summation order (partial products summed across ranks); after the cast to bfloat16
that moves a value by at most one bfloat16 unit in rare elements, so residuals, scores and
logits are compared with rtol = atol = 2**-7 (one bfloat16 unit at 1), and in practice agree
much more closely (the largest difference is printed when a test fails).

The same launch, last, checks the derived attention sites under tensor parallelism: the indexer's
recall and KL and the mean attention (``probs_mean``) are formed from each rank's own heads, the
means over heads adding the ranks' sums; no rank gathers every head (the gather fails there).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from model import TINY  # noqa: E402
from model.checkpoint import SafetensorsSource, build_model, has_mtp, load_model, save_checkpoint  # noqa: E402
from model.parallel import ParallelError, gather_heads, init_distributed, make_plan, parallelize  # noqa: E402
from model.synthetic import SyntheticSource, v3_layout, write_synthetic_checkpoint  # noqa: E402
from tests.model.test_mtp import mtp_checkpoint  # noqa: E402
from tracing.analyses.mtp import NOTE_SKIPPED  # noqa: E402
from tracing.errors import InputError  # noqa: E402
from tracing.runner import TraceRequest, run, trace_tokens  # noqa: E402
from tracing.sites import layer_site, spec  # noqa: E402

DEMO = REPO / "assets" / "demo"
# TINY's heads are 96 + 32 wide, so 2 heads per rank cut FP8 blocks: TINY splits only its experts
# and vocabulary. This variant splits everything on 128 boundaries over 2 ranks.
TP_TINY = TINY.replace(qk_nope_head_dim=64, v_head_dim=64, inter_dim=512, n_shared_experts=2)
TOKENS = 40
TOL = 2**-7
MTP_SITES = ("resid_post", "attn.indexer.topk_indices", "attn.probs", "ffn.gate.topk_indices", "ffn.routed_out", "ffn.shared_out")


def default_sites(model) -> list[str]:
    """The trace contract's default sites, plus the (gathered) attention probabilities."""
    names = []
    for i, block in enumerate(model.layers):
        names += [f"layers.{i}.{s}" for s in ("resid_pre", "resid_mid", "resid_post")]
        if block.attn.indexer is not None:
            names += [f"layers.{i}.attn.indexer.{s}" for s in ("scores", "topk_indices")]
        names.append(f"layers.{i}.attn.probs")
        if hasattr(block.ffn, "gate"):
            names += [f"layers.{i}.ffn.gate.{s}" for s in ("scores", "topk_indices", "topk_weights")]
            names += [f"layers.{i}.ffn.{s}" for s in ("routed_out", "shared_out")]
    for j, _ in enumerate(model.mtp):  # the MTP module's block (numbered n_layers + j) and its draft
        names += [f"mtp.{j}.block.{s}" for s in MTP_SITES] + [f"mtp.{j}.logits"]
    return names + ["logits.last"]


def block_of(model, name: str) -> tuple[int, bool]:
    """The block a site is in (an MTP module's: n_layers + j) and whether a rank holds its heads only."""
    if name.startswith("mtp."):
        return len(model.layers) + int(name.split(".")[1]), name.endswith("attn.probs")
    rank_local = spec(name).rank_local
    return (layer_site(name)[0] if rank_local else -1), rank_local


def record(model, plan, fn, /, *args, **kwargs) -> dict[str, torch.Tensor]:
    """Call ``fn(*args, **kwargs)`` with recording hooks on the default sites of ``model``;
    returns name -> value (batch dropped), gathered where a rank holds only its heads."""
    store, handles = {}, []
    modules = dict(model.named_modules())
    for name in default_sites(model):

        def hook(module, inputs, output, name=name):
            block, rank_local = block_of(model, name)
            if rank_local:
                output = gather_heads(output, plan, block)
            value = output.detach().cpu().clone()
            store[name] = value[0] if module.shape.startswith("B") else value  # gate sites are (N, ...)

        handles.append(modules[name].register_forward_hook(hook))
    try:
        with torch.inference_mode():
            fn(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return store


def case_tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, TOKENS), generator=torch.Generator().manual_seed(0))


def one_process(directory: Path) -> dict[str, torch.Tensor]:
    model = load_model(directory)
    tokens = case_tokens(model.args.vocab_size)
    return record(model, None, model, tokens)


# -------------------------------------------------------------------------------------------------
# the worker: python tests/test_parallel.py OUT_DIR NAME=CHECKPOINT ...


def worker(out: Path, cases: dict[str, str]) -> None:
    from model.parallel import load_parallel
    from model.stream import stream_forward

    ctx = init_distributed("cpu")
    assert ctx is not None and ctx.world == 2
    heads = cases.pop("heads", None)  # the derived sites' checkpoint, last
    for name, directory in cases.items():
        source = SafetensorsSource(directory)
        tokens = case_tokens(source.args.vocab_size)
        model, plan = load_parallel(source, "cpu")
        values = record(model, plan, model, tokens)
        held = sorted({int(n.split(".")[4]) for n, _ in model.named_parameters() if n.startswith("layers.") and ".experts." in n})
        meta = {"notes": json.dumps(plan.notes), "experts": json.dumps(held), "split": json.dumps(plan.split_attention)}
        meta["ffn"] = json.dumps([[f"{c.__module__}.{c.__qualname__}" for c in type(b.ffn).__mro__] for b in model.layers])
        loaded = load_model(source)  # loaded whole, then split (each rank keeps its part)
        lplan = parallelize(loaded)
        split_after = record(loaded, lplan, loaded, tokens)
        streamed_model = build_model(source.args, mtp=has_mtp(source))
        splan = parallelize(streamed_model)
        streamed = record(streamed_model, splan, stream_forward, streamed_model, source, tokens, "cpu", plan=splan)
        if has_mtp(source):  # the tracer's drafts (mtp.topk_*), and a model loaded without the module
            traced = trace_tokens(model, tokens[0].tolist(), plan=plan).tensors
            without, wplan = load_parallel(source, "cpu", mtp=False)
            bare = trace_tokens(without, tokens[0].tolist(), plan=wplan)
            said = {"sites": [n for n in bare.tensors if n.startswith("mtp.")], "note": bare.extra.get("mtp")}
        if ctx.rank == 0:
            save_file(values, str(out / f"{name}.safetensors"), metadata=meta)
            save_file(streamed, str(out / f"{name}-stream.safetensors"))
            save_file(split_after, str(out / f"{name}-split.safetensors"))
            if has_mtp(source):
                save_file({n: v.contiguous() for n, v in traced.items()}, str(out / f"{name}-trace.safetensors"))
                (out / f"{name}-no-mtp.json").write_text(json.dumps(said))
        else:  # rank 1's own view of the replicated values, to check the ranks agree
            save_file(values, str(out / f"{name}-rank1.safetensors"), metadata=meta)
    if "tiny" in cases:  # the load decision under torchrun: only rank 1's device is too small
        from tracing.plan import decide_load

        free = 10**12 if ctx.rank == 0 else 10**6
        load = decide_load(SafetensorsSource(cases["tiny"]), torch.device("cpu"), rank=ctx.rank, world=2, agree=True, free=free)
        (out / f"agree-{ctx.rank}.txt").write_text(load.mode)
    if heads is not None:
        rank_local_sites(out, heads, ctx.rank)  # last: it makes gathering every head fail
    torch.distributed.destroy_process_group()


# the derived attention sites from each rank's own heads

RANK_LOCAL = "layers.*.attn.indexer.recall,layers.*.attn.indexer.kl,layers.*.attn.probs_mean,layers.*.attn.indexer.topk_indices"
RUNS = {"prefill": None, "decode": TOKENS - 6}  # one prefill; or 6 decode steps of one query each
PATCHED = "layers.2.resid_post,logits.last"


def head_outputs(args) -> torch.Tensor:
    return torch.randn(TOKENS, args.n_heads, args.v_head_dim, generator=torch.Generator().manual_seed(1))  # (T, H, Dv)


def rank_local_traces(model, plan=None) -> dict[str, dict[str, torch.Tensor]]:
    """The derived sites in a prefill and in decode steps; and a run with block 1's head outputs
    patched (every head, as a one-process trace holds them), whole and at positions 5..8."""
    ids = case_tokens(model.args.vocab_size)[0].tolist()
    out = {how: trace_tokens(model, ids, record=RANK_LOCAL, plan=plan, prefill=p).tensors for how, p in RUNS.items()}
    heads = head_outputs(model.args)
    for how, positions in (("patched", None), ("patched-at", "5:9")):
        request = TraceRequest(
            token_ids=ids, record=PATCHED, patches={"layers.1.attn.head_out": heads}, patch_positions=positions
        )
        out[how] = run(model, request, plan=plan).tensors
    return out


def rank_local_sites(out: Path, directory: str, rank: int) -> None:
    import model.parallel as parallel
    from model.parallel import load_parallel
    from tracing.analyses.ranks import Ranks

    def gathered(*args, **kwargs):
        raise AssertionError("a derived site gathered every head of a block")

    parallel.gather_heads = Ranks.heads = gathered  # what recording a per-head site would call: nothing here may
    model, plan = load_parallel(SafetensorsSource(directory), "cpu")
    for how, tensors in rank_local_traces(model, plan).items():
        if rank == 0:
            meta = {"split": json.dumps(plan.split_attention)}
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / f"heads-{how}.safetensors"), meta)
    bad = head_outputs(model.args)
    bad[3, -1, 0] = float("nan")  # in the last head: rank 1's
    ids = case_tokens(model.args.vocab_size)[0].tolist()
    try:
        run(model, TraceRequest(token_ids=ids, record=PATCHED, patches={"layers.1.attn.head_out": bad}), plan=plan)
        said = "ran"
    except InputError as exc:
        said = str(exc)
    (out / f"heads-nan-rank{rank}.txt").write_text(said)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_ranks(out: Path, cases: dict[str, Path], script: Path = Path(__file__)) -> None:
    """``script OUT NAME=CHECKPOINT ...`` on two gloo ranks, as torchrun starts them (this file's worker by default)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
        env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        cmd = [sys.executable, str(script), str(out), *(f"{k}={v}" for k, v in cases.items())]
        procs.append(subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    if any(p.returncode for p in procs):
        raise AssertionError("a rank failed:\n" + "\n".join(outputs))


# -------------------------------------------------------------------------------------------------
# tests


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory) -> Path:
    source = SyntheticSource(TP_TINY, seed=2)
    tensors = {name: source.load(name) for name in source.specs()}
    return save_checkpoint(tensors, TP_TINY, tmp_path_factory.mktemp("tp") / "ckpt", n_shards=3)


@pytest.fixture(scope="module")
def mtp_tp_checkpoint(tmp_path_factory) -> Path:
    """TP_TINY with an MTP module: its block's heads, shared expert and experts split over the ranks."""
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "ckpt", TP_TINY.replace(n_mtp_layers=1))


@pytest.fixture(scope="module")
def v3_tp_checkpoint(tmp_path_factory) -> Path:
    """TP_TINY in DeepSeek-V3's family (model.v3): its own MoE arithmetic with the experts split."""
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("v3") / "ckpt", v3_layout(TP_TINY), seed=3)


@pytest.fixture(scope="module")
def cases(tiny_checkpoint, tp_checkpoint, mtp_tp_checkpoint, v3_tp_checkpoint) -> dict[str, Path]:
    found = {"tiny": tiny_checkpoint, "tp": tp_checkpoint, "mtp": mtp_tp_checkpoint, "v3": v3_tp_checkpoint}
    if (DEMO / "config.json").exists():
        found["demo"] = DEMO
    return found


@pytest.fixture(scope="module")
def heads_checkpoint(tmp_path_factory) -> Path:
    """A model whose every block's heads split over two ranks, for the derived attention sites."""
    source = SyntheticSource(TP_TINY, seed=3)
    tensors = {name: source.load(name) for name in source.specs()}
    return save_checkpoint(tensors, TP_TINY, tmp_path_factory.mktemp("heads") / "ckpt", n_shards=2)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, cases, heads_checkpoint) -> Path:
    out = tmp_path_factory.mktemp("ranks")
    run_two_ranks(out, {**cases, "heads": heads_checkpoint})
    return out


def assert_same_trace(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        other = got[name]
        assert other.shape == value.shape and other.dtype == value.dtype, name
        if value.dtype == torch.int64:
            assert torch.equal(other, value), f"{name}: selections differ"
        else:
            assert torch.equal(other.isinf(), value.isinf()), f"{name}: masks differ"
            finite = value.isfinite()
            diff = (other[finite] - value[finite]).abs().max().item() if finite.any() else 0.0
            torch.testing.assert_close(other, value, rtol=TOL, atol=TOL, msg=f"{name}: max difference {diff}")


@pytest.mark.parametrize("name", ["tiny", "tp", "mtp", "v3", "demo"])
def test_two_ranks_give_the_trace_of_one_process(two_ranks, cases, name):
    if name not in cases:
        pytest.skip("assets/demo does not exist yet")
    got = load_file(str(two_ranks / f"{name}.safetensors"))
    assert_same_trace(got, one_process(cases[name]))


@pytest.mark.parametrize("how", ["stream", "split"])
@pytest.mark.parametrize("name", ["tiny", "tp", "mtp", "v3"])
def test_two_ranks_streaming_or_splitting_a_loaded_model_give_the_trace_of_one_process(two_ranks, cases, name, how):
    got = load_file(str(two_ranks / f"{name}-{how}.safetensors"))
    assert_same_trace(got, one_process(cases[name]))


def test_two_ranks_trace_the_mtp_modules_drafts_as_one_process(two_ranks, cases):
    """The tracer's drafts over two ranks (the MTP block's heads, shared expert and experts split)
    are one process's; loaded without the module (--no-mtp), the ranks record none and say so."""
    got = load_file(str(two_ranks / "mtp-trace.safetensors"))
    model = load_model(cases["mtp"])
    want = trace_tokens(model, case_tokens(model.args.vocab_size)[0].tolist()).tensors
    assert {"mtp.topk_indices", "mtp.topk_probs"} <= set(got)
    assert_same_trace(got, want)  # the drafts' selections exactly, their probabilities within TOL
    assert json.loads((two_ranks / "mtp-no-mtp.json").read_text()) == {"sites": [], "note": NOTE_SKIPPED}
    plan = make_plan(model, rank=1, world=2, strict=True)
    assert TP_TINY.n_layers in plan.split_attention and "mtp.0.block.ffn.shared_experts.w2.weight" in plan.parts
    assert "mtp.0.block.attn.wq_b.weight" in plan.parts and "mtp.0.eh_proj.weight" not in plan.parts


def test_one_process_is_left_alone(tiny_model, tokens):
    """Without a process group nothing is split or swapped, and no collective runs."""
    classes = [type(m) for m in tiny_model.modules()]
    with torch.inference_mode():
        before = tiny_model(tokens)
    plan = parallelize(tiny_model)
    assert plan.world == 1 and not plan.parts and plan.experts == range(TINY.n_routed_experts)
    assert [type(m) for m in tiny_model.modules()] == classes
    with torch.inference_mode():
        assert torch.equal(tiny_model(tokens), before)
    assert init_distributed("cpu") is None  # no torchrun environment


def test_ranks_hold_their_part_and_agree(two_ranks):
    from safetensors import safe_open

    with safe_open(str(two_ranks / "tp.safetensors"), "pt") as f:
        meta0 = f.metadata()
    with safe_open(str(two_ranks / "tp-rank1.safetensors"), "pt") as f:
        meta1 = f.metadata()
    assert json.loads(meta0["notes"]) == [] and json.loads(meta0["split"]) == [0, 1, 2]
    assert json.loads(meta0["experts"]) == list(range(8)) and json.loads(meta1["experts"]) == list(range(8, 16))
    # every recorded value is the whole value on both ranks: bitwise the same
    a, b = load_file(str(two_ranks / "tp.safetensors")), load_file(str(two_ranks / "tp-rank1.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    with safe_open(str(two_ranks / "tiny.safetensors"), "pt") as f:
        notes = json.loads(f.metadata()["notes"])
    assert any("layers.0.attn replicated" in n for n in notes)
    with safe_open(str(two_ranks / "v3.safetensors"), "pt") as f:  # a split MoE keeps its family's arithmetic
        ffn = json.loads(f.metadata()["ffn"])
    assert ffn[0][0] == "model.v3.MLP" and all({"model.v3.MoE", "model.parallel.ExpertParallelMoE"} <= set(m) for m in ffn[1:])


def test_ranks_agree_to_stream_when_one_rank_must(two_ranks):
    """tracing.plan.decide_load with ``agree``: rank 0 could hold the model, rank 1 could not, and
    both stream (the ranks run one forward together)."""
    assert [(two_ranks / f"agree-{rank}.txt").read_text() for rank in (0, 1)] == ["stream", "stream"]


def test_two_ranks_derive_recall_kl_and_mean_attention_from_their_own_heads(two_ranks, heads_checkpoint):
    """Selections exactly, values to float32 rounding, in a prefill and in decode steps."""
    want = rank_local_traces(load_model(heads_checkpoint))
    for how in RUNS:
        got = load_file(str(two_ranks / f"heads-{how}.safetensors"))
        assert sorted(got) == sorted(want[how]) and len(got) == 1 + 4 * TP_TINY.n_layers
        for name, value in want[how].items():
            if value.dtype == torch.int64:
                assert torch.equal(got[name], value), f"{how} {name}: selections differ"
            else:
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{how} {name}")
        recall = torch.stack([got[f"layers.{i}.attn.indexer.recall"] for i in range(TP_TINY.n_layers)])
        assert (recall[:, TP_TINY.index_topk + 1 :] < 1).any()  # queries past index_topk: the selection dropped keys
    for how in ("patched", "patched-at"):  # a head's output put in on the rank that computes it
        got = load_file(str(two_ranks / f"heads-{how}.safetensors"))
        assert sorted(got) == sorted(want[how])
        for name, value in want[how].items():  # bfloat16 values after float32 sums in another order: TOL
            torch.testing.assert_close(got[name], value, rtol=TOL, atol=TOL, msg=f"{how} {name}")
    assert not torch.equal(want["patched"]["logits.last"], want["patched-at"]["logits.last"])
    for rank in (0, 1):  # a NaN in one rank's heads: every rank refuses the patch alike
        assert "holds NaN or infinite values" in (two_ranks / f"heads-nan-rank{rank}.txt").read_text()
    from safetensors import safe_open

    with safe_open(str(two_ranks / "heads-prefill.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["split"]) == list(range(TP_TINY.n_layers))  # every block's heads were split


def test_plan_splits_the_671b_model_on_block_boundaries():
    from model.config import ModelArgs
    from model.synthetic import truncate_layers

    args = truncate_layers(ModelArgs.from_file(REPO / "assets/configs/config_671B_hf.json"), 6)  # 3 dense, 3 MoE
    plan = make_plan(build_model(args), rank=3, world=8, strict=True)
    assert plan.experts == range(96, 128) and plan.split_attention == list(range(6))
    parts = plan.parts
    assert parts["layers.0.attn.wq_b.weight"].start == 3 * 16 * 192  # 16 heads of 192 per rank
    assert parts["layers.0.attn.wo.scale"].dim == 1 and parts["layers.0.attn.wo.scale"].stop == 4 * 16
    assert parts["layers.5.ffn.shared_experts.w2.weight"].stop - parts["layers.5.ffn.shared_experts.w2.weight"].start == 256
    assert parts["head.weight"].stop - parts["head.weight"].start == 129280 // 8
    assert not any(".indexer." in n for n in parts)  # the indexer stays whole on every rank


def test_strict_plan_names_the_layer_that_cannot_be_split():
    model = build_model(TINY)
    with pytest.raises(ParallelError, match=r"layers\.0\.attn replicated: wq_b rows: 192 per rank is not a multiple"):
        make_plan(model, rank=0, world=2, strict=True)
    plan = make_plan(model, rank=1, world=2)
    assert plan.experts == range(8, 16) and "embed.weight" in plan.parts and not plan.split_attention


if __name__ == "__main__":
    worker(Path(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:]))
