"""The multi-token-prediction module: its names, its loading, its drafts and their acceptance."""

from __future__ import annotations

import gzip
import json
import shutil
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model import TINY
from model.checkpoint import CheckpointError, expected_specs, load_model, save_checkpoint
from model.config import ModelArgs
from model.hooks import Hooks
from model.names import from_hf, to_hf
from model.synthetic import SyntheticSource
from tracing.analyses.mtp import NOTE_NONE, NOTE_SKIPPED, acceptance
from tracing.cli.commands import main
from tracing.runner import TraceRequest, run, trace_tokens
from tracing.tables.frames import steps_table
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[2]
REAL_NAMES = Path("/work/shared/reference/real_weight_names.txt.gz")
MTP_ARGS = TINY.replace(n_mtp_layers=1)
IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61]


def mtp_checkpoint(directory: Path, args: ModelArgs = MTP_ARGS, seed: int = 3) -> Path:
    """The tiny model's synthetic weights plus an MTP module stored as block n_layers: its block a
    copy of the last block's tensors, eh_proj random, norms at one, the embedding and head copies."""
    source = SyntheticSource(args, seed)
    tensors = {name: source.load(name) for name in source.specs()}
    n = args.n_layers
    gen = torch.Generator().manual_seed(seed)
    for name, spec in expected_specs(args, mtp=True).items():
        if name in tensors:
            continue
        rest = name.removeprefix(f"model.layers.{n}.")
        if rest == "embed_tokens.weight":
            value = tensors["model.embed_tokens.weight"].clone()
        elif rest == "shared_head.head.weight":
            value = tensors["lm_head.weight"].clone()
        elif rest == "eh_proj.weight":
            value = (torch.randn(spec.shape, generator=gen) * spec.shape[1] ** -0.5).to(spec.dtype)
        elif rest in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            value = 1 + 0.1 * torch.randn(spec.shape, generator=gen)
        else:
            value = tensors[f"model.layers.{n - 1}.{rest}"].clone()
        assert tuple(value.shape) == spec.shape, name
        tensors[name] = value.to(spec.dtype)
    return save_checkpoint(tensors, args, directory)


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory) -> Path:
    return mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny-mtp")


@pytest.fixture(scope="module")
def mtp_model(mtp_dir):
    return load_model(mtp_dir)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def draft_by_formula(model, ids: list[int]) -> torch.Tensor:
    """The MTP logits of a prefill written out: h_t the main model's normalised state, the token
    after each (the greedy one after the last), [enorm(e) ; hnorm(h)] through eh_proj, the block,
    shared_head.norm and the head."""
    mtp, eps, dtype = model.mtp[0], model.args.norm_eps, model.dtype
    seen = {}
    handle = model.norm.register_forward_hook(lambda m, i, out: seen.setdefault("h", out))
    with torch.inference_mode():
        logits = model(torch.tensor([ids]))
        handle.remove()
        h = seen["h"]  # (1, T, D) in the activation dtype
        following = torch.tensor([[*ids[1:], int(logits[0].argmax())]])
        e = model.embed.weight[following].to(dtype)
        x = torch.cat([rms(e, mtp.enorm.weight, eps).to(dtype), rms(h, mtp.hnorm.weight, eps).to(dtype)], dim=-1)
        x = F.linear(x, mtp.eh_proj.weight.to(dtype))
        from model.rope import precompute_freqs_cis

        T = len(ids)
        mask = torch.full((T, T), float("-inf")).triu_(1)
        out, residual = mtp.block(x, None, 0, precompute_freqs_cis(model.args, T), mask)
        normed = rms(out.float() + residual.float(), mtp.norm.weight, eps).to(dtype)
        return F.linear(normed.float(), model.head.weight)[0]  # (T, V)


def test_the_real_checkpoints_layer_61_is_the_mtp_module_by_name():
    real = ModelArgs.from_file(REPO / "assets" / "configs" / "config_671B_hf.json")
    assert real.n_mtp_layers == 1
    specs = {n: s for n, s in expected_specs(real, mtp=True).items() if n.startswith("model.layers.61.")}
    assert specs["model.layers.61.eh_proj.weight"].shape == (7168, 2 * 7168)
    assert specs["model.layers.61.eh_proj.weight"].dtype == torch.bfloat16  # no weight_scale_inv: not FP8
    if REAL_NAMES.exists():
        with gzip.open(REAL_NAMES, "rt") as f:
            names = {line.strip() for line in f if line.startswith("model.layers.61.")}
        assert names == set(specs)
    for name in specs:
        assert to_hf(from_hf(name, real.n_layers), real.n_layers) == name
    assert from_hf("model.layers.61.shared_head.norm.weight", 61) == "mtp.0.norm.weight"
    assert from_hf("model.layers.61.input_layernorm.weight", 61) == "mtp.0.block.attn_norm.weight"
    assert from_hf("model.layers.60.input_layernorm.weight", 61) == "layers.60.attn_norm.weight"


def test_loaded_when_present_and_the_main_logits_unchanged(mtp_dir, mtp_model):
    plain = load_model(mtp_dir, mtp=False)
    assert len(mtp_model.mtp) == 1 and len(plain.mtp) == 0
    assert mtp_model.args.n_mtp_layers == 1 and plain.args.n_mtp_layers == 0 and plain.mtp_skipped
    tokens = torch.tensor([IDS])
    with torch.inference_mode():
        alone = plain(tokens, all_logits=True)
        both, drafts = mtp_model(tokens, all_logits=True, mtp=True)
        assert torch.equal(mtp_model(tokens, all_logits=True), alone)
    assert torch.equal(both, alone) and drafts.shape == (1, len(IDS), TINY.vocab_size)
    a, b = trace_tokens(plain, IDS, record="all"), trace_tokens(mtp_model, IDS, record="all")
    assert {n for n in b.tensors if n.startswith("mtp.")} == {"mtp.0.logits", "mtp.topk_indices", "mtp.topk_probs"}
    assert set(a.tensors) == {n for n in b.tensors if not n.startswith("mtp.")}
    for name, value in a.tensors.items():  # every other site bit for bit
        assert torch.equal(value, b.tensors[name]), name
    g_a, g_b = trace_tokens(plain, IDS[:4], generate=5), trace_tokens(mtp_model, IDS[:4], generate=5)
    assert g_a.token_ids == g_b.token_ids
    assert all(torch.equal(v, g_b.tensors[n]) for n, v in g_a.tensors.items())


def test_a_prefill_records_the_draft_of_the_token_after_next(mtp_model):
    trace = trace_tokens(mtp_model, IDS)
    top, probs = trace["mtp.topk_indices"], trace["mtp.topk_probs"]
    assert top.shape == (len(IDS), 10) and top.dtype == torch.int64
    assert probs.shape == (len(IDS), 10) and probs.dtype == torch.float32
    assert (probs[:, :-1] >= probs[:, 1:]).all() and (probs.sum(-1) <= 1 + 1e-6).all() and (probs > 0).all()
    logits = draft_by_formula(mtp_model, IDS)
    want = logits.topk(10, dim=-1)
    assert torch.equal(top, want.indices)
    torch.testing.assert_close(probs, (want.values - logits.logsumexp(-1, keepdim=True)).exp(), rtol=0, atol=1e-6)
    # the drafts are the module's: another prompt's token after t changes row t, not the rows before
    other = trace_tokens(mtp_model, [*IDS[:6], 400, *IDS[7:]])["mtp.topk_indices"]
    assert torch.equal(other[:5], top[:5]) and not torch.equal(other[5:7], top[5:7])


def test_a_generation_drafts_from_the_token_just_chosen_and_counts_acceptance(mtp_model):
    trace = trace_tokens(mtp_model, IDS[:4], generate=8)
    ids, start = trace.token_ids, 4
    top = trace["mtp.topk_indices"]
    assert top.shape == (len(ids), 10)
    got = trace.extra["generation"]["mtp_acceptance"]
    accepted = sum(int(top[p - 2, 0]) == ids[p] for p in range(start + 1, len(ids)))
    assert got == {"drafts": len(ids) - start - 1, "accepted": accepted, "rate": round(accepted / (len(ids) - start - 1), 6)}
    assert acceptance(ids, top, start) == got
    # each drafted row read the token the run then had there: the same rows as a prefill of every token
    # (the decode path's products round differently: the best tokens agree where they are not near a tie)
    whole = trace_tokens(mtp_model, ids)
    near = (whole["mtp.topk_probs"][:, 0] - whole["mtp.topk_probs"][:, 1]) < 0.01
    agree = top[:-1, 0] == whole["mtp.topk_indices"][:-1, 0]
    assert (agree | near[:-1]).all()
    steps = steps_table(trace)
    assert list(steps["mtp_draft_id"][:2]) == [-1, -1] and steps["mtp_accepted"][:2].isna().all()
    for p in range(2, len(ids)):
        assert steps["mtp_draft_id"][p] == int(top[p - 2, 0])
        assert bool(steps["mtp_accepted"][p]) == (int(top[p - 2, 0]) == ids[p])
    counted = steps[steps["mtp_verified"]]  # one count: the summary's drafts are the table's verified rows
    assert list(counted["position"]) == list(range(start + 1, len(ids)))
    assert (len(counted), int(counted["mtp_accepted"].sum())) == (got["drafts"], got["accepted"])


def test_one_threads_hooks_leave_another_threads_forward(mtp_model):
    """Two threads generate with one model at once (two app sessions), one observing the MTP
    module's logits and one not: each computes what it computes alone, and the plain one never runs
    the MTP module (its decode step would continue an MTP pass its prefill never ran)."""
    model, steps = mtp_model, [IDS, [44], [7]]

    def generate(observe: bool, pause=lambda: None) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
        """Prefill and two decode steps (``pause`` between the first two): the logits, the drafts
        observed, and how often the MTP module ran."""
        logits, drafts, ran, cache = [], [], [], model.new_cache()
        with Hooks() as hooks, torch.inference_mode():
            hooks.before(model.mtp[0], lambda m, args: ran.append(1))  # on the module: observes no site
            if observe:
                hooks.after(model.mtp[0].logits, lambda m, args, out: drafts.append(out.clone()))
            for k, tokens in enumerate(steps):
                if k == 1:
                    pause()
                start = sum(len(t) for t in steps[:k])
                logits.append(model(torch.tensor([tokens]), start_pos=start, cache=cache))
        return logits, drafts, len(ran)

    alone = {"observed": generate(True), "plain": generate(False)}
    assert len(alone["observed"][1]) == alone["observed"][2] == len(steps) and alone["plain"][2] == 0

    # the plain thread prefills; the observing one registers its hook and prefills; the plain one
    # decodes while that hook is in place; then the observing one decodes
    plain_prefilled, observer_prefilled, plain_done = threading.Event(), threading.Event(), threading.Event()
    results, errors = {}, []

    def observer() -> None:
        try:
            plain_prefilled.wait(30)
            results["observed"] = generate(True, lambda: (observer_prefilled.set(), plain_done.wait(30)))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
            observer_prefilled.set()

    worker = threading.Thread(target=observer)
    worker.start()
    try:
        results["plain"] = generate(False, lambda: (plain_prefilled.set(), observer_prefilled.wait(30)))
    finally:
        plain_done.set()
        worker.join(60)
    assert not errors, errors
    for name, (logits, drafts, ran) in results.items():
        want_logits, want_drafts, want_ran = alone[name]
        assert ran == want_ran, name
        assert all(torch.equal(g, w) for g, w in zip(logits, want_logits, strict=True)), name
        assert all(torch.equal(g, w) for g, w in zip(drafts, want_drafts, strict=True)), name
        assert len(drafts) == len(want_drafts), name


def test_a_trace_with_drafts_reads_back(mtp_model, tmp_path):
    trace = trace_tokens(mtp_model, IDS[:3], generate=3)
    path = tmp_path / "t.safetensors"
    trace.save(path)
    again = Trace.load(path)
    assert again.config.n_mtp_layers == 1 and torch.equal(again["mtp.topk_indices"], trace["mtp.topk_indices"])


def test_a_checkpoint_without_one_records_nothing_and_says_so(tiny_checkpoint, mtp_dir, tmp_path, capsys):
    trace = trace_tokens(load_model(tiny_checkpoint), IDS)
    assert not any(n.startswith("mtp.") for n in trace.tensors) and trace.extra["mtp"] == NOTE_NONE
    assert trace_tokens(load_model(mtp_dir, mtp=False), IDS).extra["mtp"] == NOTE_SKIPPED
    assert "mtp" not in trace_tokens(load_model(mtp_dir), IDS).extra
    out = tmp_path / "x.safetensors"
    code = main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", "--record", "mtp.*", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists() and len(err.strip().splitlines()) == 1
    assert "no multi-token-prediction module" in err
    code = main(["run", "--checkpoint", str(mtp_dir), "--no-mtp", "--token-ids", "1,2,3", "--record", "mtp.*", "--out", str(out)])
    assert code == 2 and "not loaded" in capsys.readouterr().err
    code = main(["run", "--checkpoint", str(mtp_dir), "--token-ids", "1,2,3", "--stream", "--no-mtp", "--out", str(out)])
    assert code == 0 and Trace.load(out).extra["mtp"] == NOTE_SKIPPED  # streamed too (tests/model/test_stream.py)
    capsys.readouterr()
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", "--stream", "--record", "mtp.*"]
    code = main([*argv, "--out", str(tmp_path / "y.safetensors")])
    assert code == 2 and "no multi-token-prediction module" in capsys.readouterr().err
    assert main(["run", "--checkpoint", str(mtp_dir), "--token-ids", "1,2,3", "--generate", "4", "--out", str(out)]) == 0
    assert "MTP drafts accepted" in capsys.readouterr().err


def test_the_mtp_embedding_must_be_the_main_one(mtp_dir, tiny_checkpoint, tmp_path):
    directory = tmp_path / "other"
    shutil.copytree(mtp_dir, directory)
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    name = f"model.layers.{TINY.n_layers}.embed_tokens.weight"
    from safetensors.torch import load_file, save_file

    shard = directory / index["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(shard))
    with pytest.raises(CheckpointError, match="differs from model.embed_tokens.weight"):
        load_model(directory)
    assert len(load_model(directory, mtp=False).mtp) == 0
    with pytest.raises(CheckpointError, match="no multi-token-prediction module"):
        load_model(tiny_checkpoint, mtp=True)


def test_the_demos_drafts_are_accepted_far_above_chance():
    demo = REPO / "assets" / "demo"
    if not ModelArgs.from_file(demo).n_mtp_layers:
        pytest.skip("the demo has no MTP module")
    from tracing.tokenizer import Tokenizer

    model, tok = load_model(demo), Tokenizer(demo)
    chance = 1 / model.args.vocab_size
    trace = run(model, TraceRequest(prompt="It is a truth universally acknowledged", generate=32), tok)
    got = trace.extra["generation"]["mtp_acceptance"]
    assert got["drafts"] == 31 and got["rate"] > 50 * chance  # measured 0.4-0.5 (assets/demo/README.md)
    ids = tok.encode((demo / "heldout_sample.txt").read_text()[:2000])[: model.args.max_seq_len]
    top = trace_tokens(model, ids)["mtp.topk_indices"][:-2, 0]
    assert float((top == torch.tensor(ids[2:])).float().mean()) > 50 * chance  # teacher-forced, held-out text
