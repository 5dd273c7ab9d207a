"""How a CPU forward uses its threads: passes on one, large products on all, and the same bits in bfloat16."""

import threading

import pytest
import torch

from model import ops
from model.checkpoint import load_model
from tracing.runner import trace_tokens


@pytest.fixture
def parallel_env(env_read_once):
    """Sets ANATOMY_PARALLEL_WORK as a process starting now would find it (read once per process),
    on two threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield lambda value: env_read_once(ops.PARALLEL_ENV, value, ops.parallel_work)
    torch.set_num_threads(threads)


def test_passes_run_on_one_thread_and_large_products_on_all(parallel_env):
    parallel_env(None)
    seen = []
    with ops.serial_passes(torch.device("cpu")):
        seen.append(torch.get_num_threads())
        ops.threaded(ops.parallel_work() - 1, lambda: seen.append(torch.get_num_threads()))
        ops.threaded(ops.parallel_work(), lambda: seen.append(torch.get_num_threads()))
        with ops.serial_passes(torch.device("cpu")):  # nested: still one pass
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
    assert seen == [1, 1, 2, 1, 1] and torch.get_num_threads() == 2
    ops.threaded(1 << 40, lambda: seen.append(torch.get_num_threads()))  # outside: as torch is set
    assert seen[-1] == 2
    with pytest.raises(RuntimeError), ops.serial_passes(torch.device("cpu")):
        ops.threaded(1 << 40, lambda: (_ for _ in ()).throw(RuntimeError("a product failed")))
    assert torch.get_num_threads() == 2  # restored on the way out of a failure
    with ops.serial_passes(torch.device("meta")):
        assert torch.get_num_threads() == 2
    parallel_env("0")
    with ops.serial_passes(torch.device("cpu")):
        assert torch.get_num_threads() == 2
    assert "every pass" in ops.describe_threads()
    parallel_env("junk")
    assert ops.parallel_work() == ops._PARALLEL_WORK


def test_another_thread_keeps_its_own_setting(parallel_env):
    """The app traces in a script thread: one thread's serial pass is not another's."""
    parallel_env(None)
    seen = {}

    def other():
        torch.set_num_threads(2)
        seen["other"] = ops._THREADS.get()

    with ops.serial_passes(torch.device("cpu")):
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
    assert seen["other"] == 0


def _traces(model, ids, native: bool):
    """A trace of every default site, prefill and three decode steps, on one CPU route."""
    with ops.cpu_route(native):
        return trace_tokens(model, ids, prefill=len(ids) - 3)


@pytest.mark.parametrize("mode", ["bfloat16 native", "bfloat16 float32-route", "float32"])
@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_the_thread_policy_leaves_every_bit(which, mode, parallel_env, tiny_source, app_checkpoint):
    """In bfloat16 (the reference's dtype), on either CPU route, every recorded value (selections,
    scores, residual stream, logits) is the same bit for bit with torch's threading (every pass on
    both threads), with the passes on one thread and every product on both, and with everything on
    one thread. float32 activations: a float32 product of a few rows can round differently on one
    thread than on two (the BLAS splits its sums by thread), so there no selection moves and the
    values agree to float32 rounding."""
    dtype = torch.float32 if mode == "float32" else torch.bfloat16
    if which == "tiny":
        model, ids = load_model(tiny_source, dtype=dtype), [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400, 11, 76, 5, 17]
    else:
        path = "assets/demo" if app_checkpoint == "demo" else app_checkpoint
        model = load_model(path, dtype=dtype)
        ids = torch.randint(2, model.args.vocab_size, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for setting in ("0", "1", str(1 << 40)):
        parallel_env(setting)
        runs[setting] = _traces(model, ids, mode != "bfloat16 float32-route")
    base = runs.pop("0")
    assert any(name.endswith("topk_indices") for name in base.tensors) and "logits.last" in base.tensors
    for setting, trace in runs.items():
        assert set(trace.tensors) == set(base.tensors)
        for name in base.tensors:
            if dtype == torch.bfloat16 or name.endswith(("topk_indices", ".groups")):
                assert torch.equal(trace[name], base[name]), (setting, name)
            elif trace[name].is_floating_point():
                torch.testing.assert_close(trace[name], base[name], rtol=1e-5, atol=1e-5, equal_nan=True)
