"""The derived attention sites under tensor parallelism: the indexer's recall and KL and the mean
attention (``probs_mean``) are formed from each rank's own heads, the means over heads adding the
ranks' sums; no rank gathers every head. Two gloo ranks record what one process records:
selections exactly, values to float32 rounding, in a prefill and in decode steps.

The ranks are started as tests/model/test_parallel.py starts them (this file run as a script); a
rank that gathers the heads of a block for a derived site fails there.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
if __name__ == "__main__":
    sys.path.insert(0, str(REPO))

from safetensors.torch import load_file, save_file  # noqa: E402

from model.checkpoint import SafetensorsSource, load_model, save_checkpoint  # noqa: E402
from model.synthetic import SyntheticSource  # noqa: E402
from tests.model.test_parallel import TOKENS, TOL, TP_TINY, case_tokens, run_two_ranks  # noqa: E402
from tracing.errors import InputError  # noqa: E402
from tracing.runner import TraceRequest, run, trace_tokens  # noqa: E402

RECORD = "layers.*.attn.indexer.recall,layers.*.attn.indexer.kl,layers.*.attn.probs_mean,layers.*.attn.indexer.topk_indices"
RUNS = {"prefill": None, "decode": TOKENS - 6}  # one prefill; or 6 decode steps of one query each
PATCHED = "layers.2.resid_post,logits.last"


def head_outputs(args) -> torch.Tensor:
    return torch.randn(TOKENS, args.n_heads, args.v_head_dim, generator=torch.Generator().manual_seed(1))  # (T, H, Dv)


def traces(model, plan=None) -> dict[str, dict[str, torch.Tensor]]:
    """The derived sites in a prefill and in decode steps; and a run with block 1's head outputs
    patched (every head, as a one-process trace holds them), whole and at positions 5..8."""
    ids = case_tokens(model.args.vocab_size)[0].tolist()
    out = {how: trace_tokens(model, ids, record=RECORD, plan=plan, prefill=p).tensors for how, p in RUNS.items()}
    heads = head_outputs(model.args)
    for how, positions in (("patched", None), ("patched-at", "5:9")):
        request = TraceRequest(
            token_ids=ids, record=PATCHED, patches={"layers.1.attn.head_out": heads}, patch_positions=positions
        )
        out[how] = run(model, request, plan=plan).tensors
    return out


def worker(out: Path, cases: dict[str, str]) -> None:
    import model.parallel as parallel
    from model.parallel import init_distributed, load_parallel
    from tracing.analyses.ranks import Ranks

    def gathered(*args, **kwargs):
        raise AssertionError("a derived site gathered every head of a block")

    parallel.gather_heads = Ranks.heads = gathered  # what recording a per-head site would call: nothing here may
    ctx = init_distributed("cpu")
    for name, directory in cases.items():
        model, plan = load_parallel(SafetensorsSource(directory), "cpu")
        for how, tensors in traces(model, plan).items():
            if ctx.rank == 0:
                meta = {"split": json.dumps(plan.split_attention)}
                save_file({n: t.contiguous() for n, t in tensors.items()}, str(out / f"{name}-{how}.safetensors"), meta)
        bad = head_outputs(model.args)
        bad[3, -1, 0] = float("nan")  # in the last head: rank 1's
        ids = case_tokens(model.args.vocab_size)[0].tolist()
        try:
            run(model, TraceRequest(token_ids=ids, record=PATCHED, patches={"layers.1.attn.head_out": bad}), plan=plan)
            said = "ran"
        except InputError as exc:
            said = str(exc)
        (out / f"{name}-nan-rank{ctx.rank}.txt").write_text(said)
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A model whose every block's heads split over two ranks."""
    source = SyntheticSource(TP_TINY, seed=3)
    tensors = {name: source.load(name) for name in source.specs()}
    return save_checkpoint(tensors, TP_TINY, tmp_path_factory.mktemp("heads") / "ckpt", n_shards=2)


def test_two_ranks_derive_recall_kl_and_mean_attention_from_their_own_heads(checkpoint, tmp_path):
    run_two_ranks(tmp_path, {"tp": checkpoint}, script=Path(__file__))
    want = traces(load_model(checkpoint))
    for how in RUNS:
        got = load_file(str(tmp_path / f"tp-{how}.safetensors"))
        assert sorted(got) == sorted(want[how]) and len(got) == 1 + 4 * TP_TINY.n_layers
        for name, value in want[how].items():
            if value.dtype == torch.int64:
                assert torch.equal(got[name], value), f"{how} {name}: selections differ"
            else:
                torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6, msg=f"{how} {name}")
        recall = torch.stack([got[f"layers.{i}.attn.indexer.recall"] for i in range(TP_TINY.n_layers)])
        assert (recall[:, TP_TINY.index_topk + 1 :] < 1).any()  # queries past index_topk: the selection dropped keys
    for how in ("patched", "patched-at"):  # a head's output put in on the rank that computes it
        got = load_file(str(tmp_path / f"tp-{how}.safetensors"))
        assert sorted(got) == sorted(want[how])
        for name, value in want[how].items():  # bfloat16 values after float32 sums in another order: TOL
            torch.testing.assert_close(got[name], value, rtol=TOL, atol=TOL, msg=f"{how} {name}")
    assert not torch.equal(want["patched"]["logits.last"], want["patched-at"]["logits.last"])
    for rank in (0, 1):  # a NaN in one rank's heads: every rank refuses the patch alike
        assert "holds NaN or infinite values" in (tmp_path / f"tp-nan-rank{rank}.txt").read_text()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "tp-prefill.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["split"]) == list(range(TP_TINY.n_layers))  # every block's heads were split


if __name__ == "__main__":
    worker(Path(sys.argv[1]), dict(arg.split("=", 1) for arg in sys.argv[2:]))
