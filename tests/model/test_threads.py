"""The thread policy: a context that sets this OS thread's counts only, restores them, and leaves
every other thread (and every bit) alone; importing the project changes nothing."""

import json
import multiprocessing
import os
import subprocess
import sys
import threading

import pytest
import torch

from model import kernels
from model.checkpoint import load_model
from model.kernels import threads
from tracing.runner import trace_tokens

IDS = [5, 17, 300, 2, 9, 44, 123, 7, 88, 61, 250, 3, 19, 400, 11, 76, 5, 17]
pytestmark = pytest.mark.skipif(not threads.runtime().available, reason="the OpenMP runtime is not libgomp")


@pytest.fixture
def two_threads(env_read_once):
    """Two torch threads in this thread, and ANATOMY_PARALLEL_WORK as a process starting now would find it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield lambda value: env_read_once(threads.PARALLEL_ENV, value, threads.parallel_work)
    torch.set_num_threads(before)


def test_passes_run_on_one_thread_and_large_products_on_all(two_threads):
    two_threads(None)
    seen = []
    with kernels.serial_passes():
        seen.append(torch.get_num_threads())
        threads.threaded(threads.parallel_work() - 1, lambda: seen.append(torch.get_num_threads()))
        threads.threaded(threads.parallel_work(), lambda: seen.append(torch.get_num_threads()))
        with kernels.serial_passes():  # nested: still one pass
            seen.append(torch.get_num_threads())
        seen.append(torch.get_num_threads())
    assert seen == [1, 1, 2, 1, 1] and torch.get_num_threads() == 2
    threads.threaded(1 << 40, lambda: seen.append(torch.get_num_threads()))  # outside: as torch is set
    assert seen[-1] == 2
    with pytest.raises(RuntimeError), kernels.serial_passes():
        threads.threaded(1 << 40, lambda: (_ for _ in ()).throw(RuntimeError("a product failed")))
    assert torch.get_num_threads() == 2  # restored on the way out of a failure
    with kernels.plain(), kernels.serial_passes():  # the routes off: torch's threading
        assert torch.get_num_threads() == 2
    two_threads("0")
    with kernels.serial_passes():
        assert torch.get_num_threads() == 2
    assert "every pass" in threads.describe()
    two_threads("junk")
    assert threads.parallel_work() == threads.DEFAULT_WORK and "'junk' ignored" in threads.describe()


def test_the_policy_is_this_threads_only(two_threads):
    """While one thread is inside the policy, another keeps its count, and a thread started then
    starts from the process's count: nothing process-wide was set."""
    two_threads(None)
    inside, go = threading.Event(), threading.Event()
    seen = {}

    def policy():
        with kernels.serial_passes():
            seen["inside"] = torch.get_num_threads()
            inside.set()
            go.wait(10)

    worker = threading.Thread(target=policy)
    worker.start()
    inside.wait(10)
    seen["here"] = torch.get_num_threads()
    fresh = threading.Thread(target=lambda: seen.__setitem__("fresh", torch.get_num_threads()))
    fresh.start()
    fresh.join()
    go.set()
    worker.join()
    assert seen == {"inside": 1, "here": 2, "fresh": 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_two_traces_at_once_keep_their_bits_and_leave_the_counts(dtype, two_threads, tiny_source, app_checkpoint):
    """Two threads trace at once (as two app sessions do): each trace is the one it makes alone, bit
    for bit (in float32 too, where a product of a few rows rounds by its thread count: each keeps
    its own), and every thread's count, theirs, this one's and a new thread's, is as it was."""
    two_threads(None)
    path = "assets/demo" if app_checkpoint == "demo" else app_checkpoint
    jobs = {"tiny": (load_model(tiny_source, dtype=dtype), IDS), "demo": (load_model(path, dtype=dtype), IDS * 3)}

    def trace(name):
        model, ids = jobs[name]
        return trace_tokens(model, [i % model.args.vocab_size for i in ids], prefill=len(ids) - 4, generate=3)

    alone = {name: trace(name) for name in jobs}
    results, counts, errors = {}, {}, []
    start = threading.Barrier(3)

    def run(name):
        try:
            before = torch.get_num_threads()
            start.wait(10)
            for _ in range(3):
                results[name] = trace(name)
            counts[name] = (before, torch.get_num_threads())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(name,)) for name in jobs]
    for w in workers:
        w.start()
    start.wait(10)
    fresh = threading.Thread(target=lambda: counts.__setitem__("fresh", torch.get_num_threads()))
    fresh.start()
    fresh.join()
    for w in workers:
        w.join()
    assert not errors, errors
    assert counts == {"tiny": (2, 2), "demo": (2, 2), "fresh": 2} and torch.get_num_threads() == 2
    for name, trace_ in results.items():
        for site, value in alone[name].tensors.items():
            assert torch.equal(trace_[site], value), (name, site)


def test_importing_the_project_changes_no_setting():
    """``import model, tracing, app`` leaves the environment and torch's thread counts as they were."""
    code = (
        "import os, json, torch; env = dict(os.environ); n = torch.get_num_threads(); "
        "import model, tracing, app, model.kernels, tracing.cli, tracing.runner; "
        "print(json.dumps({'env': dict(os.environ) == env, 'threads': torch.get_num_threads() == n}))"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=os.getcwd())
    assert json.loads(out.stdout) == {"env": True, "threads": True}


def _forward_in_child(model, tokens, queue):
    with torch.inference_mode(), kernels.serial_passes():
        queue.put(model(tokens).tolist())


def test_a_forked_child_after_a_forward_works(two_threads, tiny_model):
    """After a forward in the parent (the helper threads and OpenMP's team made), a forked child
    runs a forward of its own inside the policy and gets the parent's logits."""
    two_threads(None)
    tokens = torch.tensor([IDS])
    with torch.inference_mode(), kernels.serial_passes():
        want = tiny_model(tokens).tolist()
    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_forward_in_child, args=(tiny_model, tokens, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(30)
    assert child.exitcode == 0 and got == want


@pytest.mark.parametrize("mode", ["bfloat16 native", "bfloat16 float32-route", "float32"])
@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_the_thread_policy_leaves_every_bit(which, mode, two_threads, tiny_source, app_checkpoint):
    """In bfloat16 (the reference's dtype), on either CPU route, every recorded value (selections,
    scores, residual stream, logits) is the same bit for bit with torch's threading (every pass on
    both threads), with the passes on one thread and every product on both, and with everything on
    one thread. float32 activations: a float32 product of a few rows can round differently on one
    thread than on two (the BLAS splits its sums by thread), so there no selection moves and the
    values agree to float32 rounding."""
    dtype = torch.float32 if mode == "float32" else torch.bfloat16
    if which == "tiny":
        model, ids = load_model(tiny_source, dtype=dtype), IDS
    else:
        path = "assets/demo" if app_checkpoint == "demo" else app_checkpoint
        model = load_model(path, dtype=dtype)
        ids = torch.randint(2, model.args.vocab_size, (96,), generator=torch.Generator().manual_seed(3)).tolist()
    runs = {}
    for setting in ("0", "1", str(1 << 40)):
        two_threads(setting)
        with kernels.cpu_route(mode != "bfloat16 float32-route"):
            runs[setting] = trace_tokens(model, ids, prefill=len(ids) - 3)
    base = runs.pop("0")
    assert any(name.endswith("topk_indices") for name in base.tensors) and "logits.last" in base.tensors
    for setting, trace in runs.items():
        assert set(trace.tensors) == set(base.tensors)
        for name in base.tensors:
            if dtype == torch.bfloat16 or name.endswith(("topk_indices", ".groups")):
                assert torch.equal(trace[name], base[name]), (setting, name)
            elif trace[name].is_floating_point():
                torch.testing.assert_close(trace[name], base[name], rtol=1e-5, atol=1e-5, equal_nan=True)
