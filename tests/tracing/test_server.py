"""The model server (python -m tracing serve): one load, many requests; the trace a request gets is
the file ``tracing run`` writes; bad requests get one line and the server goes on; a client that goes
away ends its request; a rank that dies ends the server.

The HTTP side runs in this process against a loaded model (Starlette's TestClient, the worker loop on
a thread); the command line's server runs as a process, one rank and two (torchrun, gloo).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from starlette.testclient import TestClient

from tests.tracing.serving import TOKEN, in_process, post
from tracing.analyses.graph import Graph
from tracing.cli.commands import main
from tracing.cli.loading import open_checkpoint
from tracing.client import read_answer
from tracing.errors import InputError
from tracing.runner import TraceRequest, run
from tracing.server.ranks import Fault
from tracing.server.wire import encode_request
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[2]
PROMPT = "It is a truth universally acknowledged, that a single man"
JSON = {"content-type": "application/json"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the HTTP side in this process ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def served(app_checkpoint):
    """The app of tracing.server.http over the dev/demo checkpoint, its worker loop on a thread."""
    with in_process(app_checkpoint) as got:
        yield got


def test_a_trace_over_http_is_the_trace_run_makes(served):
    client, state, loaded = served
    request = TraceRequest(prompt=PROMPT, generate=3, attribute=True, interventions={"no_bias": "all"})
    answer = post(client, request)
    assert answer.status_code == 200
    events = []
    data = read_answer(iter([answer.content]), events.append)
    want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
    assert data == want.to_bytes()
    assert {"queued": 1} in events and any("progress" in e for e in events)
    assert events[-1]["progress"]["steps"] == 3  # the last event is the last step's last block
    patched = TraceRequest(prompt=PROMPT, patches={"layers.0.resid_pre": want["layers.0.resid_pre"][: len(want["tokens"]) - 3]})
    answer = post(client, patched)
    assert answer.status_code == 200 and Trace.from_bytes(read_answer(iter([answer.content]))).extra["patched"] == [
        "layers.0.resid_pre"
    ]


def test_a_graph_on_the_server_makes_the_local_trace(served):
    """docs/examples' mean ablation travels as JSON (the steering one, with its tensor, through the
    command line in test_server_commands.py); the server's trace is the one a run here makes, to the
    byte. A graph that does not fit the model is refused before the queue."""
    client, state, loaded = served
    graph = Graph.load(REPO / "docs" / "examples" / "mean_ablation.json")
    request = TraceRequest(prompt="It is a truth", generate=2, graph=graph)
    answer = post(client, request)
    assert answer.status_code == 200, answer.text
    want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
    assert read_answer(iter([answer.content])) == want.to_bytes() and "graph.attn_out_mean" in want
    wide = Graph()
    wide.add("layers.1.resid_pre", wide.constant(torch.ones(3)))  # the model's width is not 3
    answer = post(client, TraceRequest(prompt="It is", graph=wide))
    assert answer.status_code == 422 and "has shape [3]" in answer.json()["error"]


def test_a_gradient_over_http_is_the_gradient_run_takes(served):
    client, state, loaded = served
    request = TraceRequest(prompt=PROMPT, record=("logits.last", "layers.*.grad.attn.head_out"), gradient_of=(5, 9))
    answer = post(client, request)
    assert answer.status_code == 200
    want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label})
    assert read_answer(iter([answer.content])) == want.to_bytes() and "layers.1.grad.attn.head_out" in want.tensors
    answer = post(client, TraceRequest(prompt=PROMPT, gradient_of=(5, 9), generate=2))
    assert answer.status_code == 422 and "cannot be combined with --generate" in answer.text
    limits, state.limits = state.limits, dataclasses.replace(state.limits, max_gradient_tokens=4)
    try:  # the backward keeps every block's T x T attention: bounded apart, before the queue
        answer = post(client, request)
    finally:
        state.limits = limits
    assert answer.status_code == 422 and "a backward pass of at most 4" in answer.text


def test_features_over_http_name_the_servers_dictionaries(served, tmp_path):
    """A request names the dictionaries the server was started with (serve --dictionaries DIR) and
    gets the trace a run here makes with them, a feature edit included; a name it lacks, a path, a
    dictionary that does not fit the model: one line, before the queue."""
    from tracing.dictionary import Dictionary, save
    from tracing.dictionary.features import load_catalogue

    client, state, loaded = served
    dim = loaded.model.args.dim
    for name, width in (("resid", dim), ("wide", dim + 4)):
        d = Dictionary("sae", "layers.1.resid_post", width, 32, 4).init_weights(torch.Generator().manual_seed(1))
        save(d, tmp_path / ("bad" if width != dim else "good") / name)
    with pytest.raises(InputError, match="the model's stream is"):  # serve refuses to start with it
        load_catalogue(tmp_path / "bad", loaded.model.args)
    catalogue = load_catalogue(tmp_path / "good", loaded.model.args)
    request = TraceRequest(
        prompt="It is a truth", dictionaries=("resid",), interventions={"features": "layers.1.resid_post:3*2@2:"}
    )
    state.model.dictionaries = catalogue
    try:
        answer = post(client, request)
        refused = [
            post(client, dataclasses.replace(request, dictionaries=(name,)))
            for name in ("other", str(tmp_path / "good" / "resid"))
        ]
        beyond = post(client, dataclasses.replace(request, interventions={"features": "layers.1.resid_post:32=0"}))
    finally:
        state.model.dictionaries = {}
    assert answer.status_code == 200, answer.text
    want = run(loaded.model, request, loaded.tokenizer, extra={"checkpoint": loaded.label}, dictionaries=catalogue)
    assert read_answer(iter([answer.content])) == want.to_bytes() and "layers.1.resid_post.features.top_ids" in want.tensors
    assert beyond.status_code == 422 and "has features 0..31" in beyond.json()["error"]  # before the queue
    for answer in refused:
        assert answer.status_code == 422 and "not one of this server's (resid)" in answer.json()["error"]
    answer = post(client, request)  # the server holds none now
    assert answer.status_code == 422 and "serve --dictionaries DIR" in answer.json()["error"]


@pytest.mark.parametrize(
    "body, kind, status, words",
    [
        (b'{"prompt": "x", "generate": 99}', "application/json", 422, "at most 8 tokens"),
        (json.dumps({"prompt": "word " * 200}).encode(), "application/json", 422, "at most 64"),
        (b'{"token_ids": [1, 2], "record": ["layers.*.nothing"]}', "application/json", 422, "matches no trace site"),
        (b'{"token_ids": [1, 2], "interventions": {"ablate": "x:y"}}', "application/json", 422, "--ablate-experts"),
        (b'{"token_ids": [1, 2], "temperature": 2}', "application/json", 422, "--temperature applies to --generate"),
        (b"not json", "application/json", 422, "not JSON"),
        (b"\x10\x00\x00\x00\x00\x00\x00\x00{broken", "application/x-safetensors", 422, "not a readable safetensors"),
        (b"x" * (2 << 20), "application/json", 413, "larger than this server takes"),
        (b"<xml/>", "text/xml", 422, "send the request as application/json"),
    ],
)
def test_a_bad_request_gets_one_line_and_the_server_goes_on(served, body, kind, status, words):
    client, state, loaded = served
    answer = client.post("/trace", content=body, headers={"content-type": kind})
    assert answer.status_code == status and words in answer.json()["error"]
    assert "\n" not in answer.json()["error"]
    good = post(client, TraceRequest(token_ids=(1, 2, 3)))
    assert good.status_code == 200 and read_answer(iter([good.content]))


_SAVE = {"op": "save", "name": "x", "value": "x"}
# values the CLI refuses, each of which once ended every rank or ran as another value
BAD_VALUES = {
    "subnormal temperature": ({"generate": 2, "temperature": 1e-320}, "--temperature must be 0 (greedy) or a finite number"),
    "no_bias text": ({"interventions": {"no_bias": "x"}}, "no_bias: expected"),
    "no_bias object": ({"interventions": {"no_bias": {"a": 1}}}, "no_bias: expected"),
    "no_bias number": ({"interventions": {"no_bias": 5}}, "no_bias: expected"),
    "unknown intervention": ({"interventions": {"a": 1}}, "unknown intervention 'a'"),
    "attention list": ({"interventions": {"attention": [1]}}, "attention: expected"),
    "attention infinite": ({"interventions": {"attention": float("inf")}}, "attention: expected"),
    "attention fraction": ({"interventions": {"attention": 2.7}}, "attention: expected"),
    "ablate null ids": ({"interventions": {"ablate": {"1": None}}}, "blocks and ids must be integers"),
    "a head the model lacks": ({"interventions": {"ablate_heads": "1:999"}}, "heads are numbered 0.."),
    "a position past the run": ({"attribute": True, "position": 99}, "--position 99: the run has positions 0.."),
    "prefill past the prompt": ({"prefill": 99}, "--prefill 99: must be between 1 and"),
    "100,000 patterns": ({"record": ["*"] * 100_000}, "this server takes at most 64"),
    "a 500 kB prompt": ({"prompt": "It is a truth " * 40_000}, "characters; this server takes at most"),
    "a 500 kB target": ({"attribute": True, "target": "x" * 500_000}, "more than one token holds"),
    "a long pattern": ({"record": ["layers.*" + "*" * 300]}, "at most 200"),
    "a graph of 300 ops": ({"graph": {"graph": 1, "ops": [{"op": "const", "id": "c", "value": 1}] * 300}}, "at most 256"),
    "a graph past the run": (
        {"graph": {"graph": 1, "ops": [{"op": "read", "id": "x", "site": "layers.1.resid_pre", "positions": [9]}, _SAVE]}},
        "position 9 is outside the run's 0..",
    ),
}


def bad_value(case: str, hidden: int) -> tuple[bytes, str, str]:
    """(body, content type, words of the error) of a request with one bad value."""
    if case == "5,000 patches":
        patches = {f"layers.0.p{i}": torch.zeros(1) for i in range(5000)}
        return *encode_request(TraceRequest(token_ids=(1, 2, 3), patches=patches)), "5,000 patches; this server takes at most"
    if case == "float8 patch":
        patch = {"layers.0.resid_pre": torch.zeros(3, hidden).to(torch.float8_e4m3fn)}
        return *encode_request(TraceRequest(token_ids=(1, 2, 3), patches=patch)), "is float8_e4m3fn: a patch holds float32"
    fields, words = BAD_VALUES[case]
    body = json.dumps({"prompt": "It is a truth", **fields})  # Infinity where the JSON says so, as a client may send it
    return body.encode(), "application/json", words


def refused_before_queueing(answer, words: str) -> None:
    """A 4xx with one line, a plain JSON answer: the request never reached the queue, nor a rank."""
    assert 400 <= answer.status_code < 500 and answer.headers["content-type"] == "application/json", answer.content[:300]
    error = answer.json()["error"]
    assert words in error and "\n" not in error and len(error) < 300


@pytest.mark.parametrize("case", [*BAD_VALUES, "float8 patch", "5,000 patches"])
def test_a_bad_value_is_one_line_before_the_queue(served, case):
    client, state, loaded = served
    body, kind, words = bad_value(case, loaded.model.args.dim)
    ran = state.model.requests
    refused_before_queueing(client.post("/trace", content=body, headers={"content-type": kind}), words)
    assert state.model.requests == ran  # the model never saw it
    good = post(client, TraceRequest(token_ids=(1, 2, 3)))
    assert good.status_code == 200 and read_answer(iter([good.content]))


@pytest.mark.parametrize("kind, status, words", [("error", 500, "RuntimeError: injected fault"), ("oom", 503, "out of memory")])
def test_a_failure_in_one_process_is_one_line_and_the_next_request_runs(served, kind, status, words):
    client, state, loaded = served
    state.model.faults = [Fault(state.model.requests + 1, 1, kind)]  # the next request, at block 1
    try:
        answer = post(client, TraceRequest(token_ids=(1, 2, 3), generate=1))
        *events, last = [json.loads(line) for line in answer.content.splitlines()]
        assert last["status"] == status and words in last["error"] and not any("error" in e for e in events)
    finally:
        state.model.faults = []
    good = post(client, TraceRequest(token_ids=(1, 2, 3), generate=1))
    assert Trace.from_bytes(read_answer(iter([good.content]))).extra["generation"]["generated"] == 1


@pytest.mark.parametrize(
    "patches, words",
    [
        ({"layers.0.resid_pre": torch.zeros(5, 2)}, "patch 'layers.0.resid_pre' has shape [5, 2], this run needs [3, "),
        ({"layers.0.nowhere": torch.zeros(3, 2)}, "patch 'layers.0.nowhere' is not a trace site"),
        ({"layers.0.attn.indexer.recall": torch.zeros(3)}, "is not a trace site this model can patch"),
    ],
)
def test_a_patch_that_does_not_fit_is_refused_with_one_line(served, patches, words):
    client, state, loaded = served
    answer = post(client, TraceRequest(token_ids=(1, 2, 3), patches=patches))
    assert answer.status_code == 422 and words in answer.json()["error"]
    assert read_answer(iter([post(client, TraceRequest(token_ids=(1, 2, 3))).content]))


def test_no_token_no_answer_and_health_tells_the_state(served):
    client, state, loaded = served
    bare = TestClient(client.app)
    for path, method in (("/trace", "POST"), ("/info", "GET"), ("/encode", "POST")):
        answer = bare.request(method, path, content=b"{}", headers={"authorization": "Bearer wrong-token-of-length"})
        assert answer.status_code == 401 and "token" in answer.json()["error"]
    health = bare.get("/health")  # health needs no token: it says whether the model is up, nothing of it
    assert health.status_code == 200 and health.json()["queue"] == 0
    held, state.model = state.model, None
    try:
        assert bare.get("/health").status_code == 503
        assert client.post("/trace", content=b"{}").status_code == 503
    finally:
        state.model = held


def test_a_full_queue_says_so(served):
    client, state, loaded = served
    state.jobs.limit, limit = 0, state.jobs.limit
    try:
        answer = post(client, TraceRequest(token_ids=(1, 2, 3)))
        assert answer.status_code == 503 and "queue is full" in answer.json()["error"]
    finally:
        state.jobs.limit = limit


# --- the command line's server ----------------------------------------------------------------------


def start(args: list[str], ranks: int = 1, port: int | None = None, env: dict | None = None):
    """``python -m tracing serve ...`` (under torchrun for several ranks), once its /health answers 200."""
    port = port or free_port()
    serve = ["-m", "tracing", "serve", *args, "--port", str(port)]
    if ranks > 1:
        launch = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1"]
        serve = [*launch, "--master-port", str(free_port()), *serve]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen([sys.executable, *serve], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server stopped: {proc.stdout.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise AssertionError("the server did not come up in 120 s")


def stop(proc) -> str:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.stdout.read().decode()


@pytest.fixture(scope="module")
def two_rank_server(app_checkpoint):
    """A two-rank server for the module (its process and URL); its last test kills a rank."""
    proc, url = start(["--checkpoint", app_checkpoint, "--collective-timeout", "10"], ranks=2)
    yield proc, url
    stop(proc)


@pytest.fixture
def two_ranks(two_rank_server) -> str:
    proc, url = two_rank_server
    assert proc.poll() is None, "the two-rank server has ended (a test that kills a rank runs last)"
    return url


RUNS = {
    "prefill": [],
    "generate": ["--generate", "4"],
    "attribute": ["--attribute", "--record", "default,flow"],
    "intervention": ["--no-gate-bias", "--ablate-heads", "1:0", "--zero-experts", "2:3"],
}
GRAPH_RUN = ["--generate", "2", "--graph", str(REPO / "docs" / "examples" / "mean_ablation.json")]  # every rank runs it


@pytest.mark.parametrize(
    "flags", [*RUNS.values(), pytest.param(GRAPH_RUN, id="graph", marks=pytest.mark.slow)], ids=[*RUNS, "graph"]
)
def test_run_on_a_two_rank_server_writes_the_one_process_trace(two_ranks, app_checkpoint, tmp_path, flags):
    local, remote = tmp_path / "local.safetensors", tmp_path / "remote.safetensors"
    argv = ["run", "--prompt", PROMPT, *flags]
    assert main([*argv, "--checkpoint", app_checkpoint, "--out", str(local)]) == 0
    assert main([*argv, "--server", two_ranks, "--out", str(remote), "--csv", str(tmp_path / "csv")]) == 0
    a, b = Trace.load(local), Trace.load(remote)
    if a.config.n_mtp_layers:  # the ranks split and run the MTP module as one process runs it
        assert {"mtp.topk_indices", "mtp.topk_probs"} <= set(b.tensors) and "mtp" not in b.extra
    assert set(a.tensors) == set(b.tensors) and a.extra == b.extra and (tmp_path / "csv" / "tokens.csv").is_file()
    for name in a.tensors:
        if a[name].is_floating_point() and flags:  # as the torchrun tests: partial sums meet in another order
            torch.testing.assert_close(a[name], b[name], rtol=2**-7, atol=1e-5, equal_nan=True)
        else:
            assert torch.equal(a[name], b[name]), name  # selections, tokens, the prefill's default sites: exactly


def test_a_gradient_on_two_ranks_is_the_one_process_gradient(two_ranks, app_checkpoint):
    """Every rank runs the backward pass; the collectives' gradients make each rank's the whole one."""
    request = TraceRequest(prompt=PROMPT, record=("logits.last", "layers.*.grad.*"), gradient_of=(5, 9))
    body, kind = encode_request(request)
    answer = httpx.post(f"{two_ranks}/trace", content=body, headers={"content-type": kind}, timeout=120)
    assert answer.status_code == 200, answer.text
    remote = Trace.from_bytes(read_answer(iter([answer.content])))
    loaded = open_checkpoint(app_checkpoint)
    local = run(loaded.model, request, loaded.tokenizer)
    assert set(local.tensors) == set(remote.tensors) and len([n for n in local.tensors if ".grad." in n]) > 10
    for name, value in local.tensors.items():  # partial sums meet in another order, forward and backward
        torch.testing.assert_close(remote[name], value, rtol=0.01, atol=0.01 * float(value.abs().max()), msg=name)


def test_bad_values_on_two_ranks_are_refused_and_the_ranks_serve_on(two_ranks):
    hidden = httpx.get(f"{two_ranks}/info", timeout=30).json()["config"]["hidden_size"]
    for case in [*BAD_VALUES, "float8 patch", "5,000 patches"]:
        body, kind, words = bad_value(case, hidden)
        refused_before_queueing(httpx.post(f"{two_ranks}/trace", content=body, headers={"content-type": kind}, timeout=30), words)
    good = httpx.post(f"{two_ranks}/trace", content=b'{"token_ids": [1, 2, 3], "generate": 1}', headers=JSON, timeout=60)
    assert Trace.from_bytes(read_answer(iter([good.content]))).extra["generation"]["generated"] == 1


def open_request(url: str, body: bytes, until: bytes) -> socket.socket:
    """A client on a plain socket that sent ``body`` to /trace and read the answer up to ``until``."""
    host, port = url.removeprefix("http://").split(":")
    client = socket.create_connection((host, int(port)), timeout=30)
    head = f"POST /trace HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    client.sendall(head.encode() + body)
    seen = b""
    while until not in seen:
        seen += client.recv(4096)
    return client


def wait_for(url: str, ready, seconds: float = 30) -> dict:
    deadline = time.monotonic() + seconds
    while not ready(health := httpx.get(f"{url}/health", timeout=10).json()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return health


def test_a_queued_request_whose_client_left_is_dropped(two_ranks):
    running = open_request(two_ranks, b'{"token_ids": [1, 2, 3], "generate": 150}', b'"progress"')
    queued = open_request(two_ranks, b'{"token_ids": [1, 2, 3]}', b'"queued"')
    assert wait_for(two_ranks, lambda h: h["queue"] == 1)["running"]
    queued.close()
    health = wait_for(two_ranks, lambda h: h["queue"] == 0)
    assert health["queue"] == 0 and health["running"]  # gone from the queue while the other still runs
    running.close()
    assert not wait_for(two_ranks, lambda h: not h["running"])["running"]
    good = httpx.post(f"{two_ranks}/trace", content=b'{"token_ids": [1, 2, 3]}', headers=JSON, timeout=60)
    assert Trace.from_bytes(read_answer(iter([good.content])))["tokens"].tolist() == [1, 2, 3]


def answer_lines(url: str, body: bytes) -> list[dict]:
    """The event lines of an answer that ends in an error (one JSON object each)."""
    answer = httpx.post(f"{url}/trace", content=body, headers=JSON, timeout=60)
    assert answer.status_code == 200
    return [json.loads(line) for line in answer.content.splitlines() if line]


def test_one_rank_failing_mid_request_is_one_line_and_the_next_request_runs(app_checkpoint):
    # rank 1 loads 4 s late (longer than the collective timeout: the ranks wait for it, the server
    # answers 503 meanwhile), raises in its 1st request at block 1, runs out of memory in its 3rd at
    # block 2, and fails inside block 1 (between the model's collectives) in its 5th
    faults = {"ANATOMY_SERVER_FAULTS": "1:1:1:error,1:3:2:oom,1:5:1:mid", "ANATOMY_SERVER_LOAD_DELAY": "1:4"}
    proc, url = start(["--checkpoint", app_checkpoint, "--collective-timeout", "3"], ranks=2, env=faults)
    body = b'{"token_ids": [1, 2, 3, 4], "generate": 2}'
    try:
        failures = ((500, "rank 1: RuntimeError: injected fault in request 1 at block 1"), (503, "rank 1: out of memory"))
        for status, words in failures:
            *progress, last = answer_lines(url, body)
            assert last["status"] == status and words in last["error"] and not any("error" in e for e in progress)
            good = Trace.from_bytes(read_answer(iter([httpx.post(f"{url}/trace", content=body, headers=JSON).content])))
            assert good.extra["generation"]["generated"] == 2  # the ranks are in step: the next request runs
        started = time.monotonic()
        *waiting, last = answer_lines(url, body)  # rank 0 waits in the FFN's collective until it times out
        assert last["status"] == 500 and "injected fault in request 5" in last["error"] and "out of step" in last["error"]
        assert any("heartbeat" in e for e in waiting)  # a line every 2 s while the request could not go on
        proc.wait(30)  # the server ends by itself, with the reason
        assert proc.returncode != 0 and time.monotonic() - started < 30
    finally:
        log = stop(proc)
    assert "error: rank 0 stops: rank 1: RuntimeError: injected fault in request 5" in log, log[-3000:]


def test_the_python_client_and_a_client_killed_mid_generation(two_ranks, tmp_path):
    from tracing.client import Client

    with Client(two_ranks) as client:
        assert client.health()["ranks"] == 2 and client.info()["config"]["model_type"] == "deepseek_v32"
        assert client.encode(TraceRequest(prompt=PROMPT))[0] == client.trace(prompt=PROMPT)["tokens"][0]
        out = tmp_path / "gone.safetensors"
        argv = [sys.executable, "-m", "tracing", "run", "--server", two_ranks, "--prompt", PROMPT, "--generate", "150"]
        gone = subprocess.Popen([*argv, "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 30
        while not client.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        gone.kill()  # mid-generation: the server ends its request at the next block
        gone.wait()
        deadline = time.monotonic() + 30
        while client.health()["running"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not client.health()["running"] and not out.exists()
        assert client.trace(prompt=PROMPT, generate=2).extra["generation"]["generated"] == 2  # serving on


def test_a_token_is_needed_off_loopback_and_checked(app_checkpoint, tmp_path, capsys):
    code = main(["serve", "--checkpoint", app_checkpoint, "--host", "0.0.0.0"])
    assert code == 2 and "--token-file" in capsys.readouterr().err
    (tmp_path / "short").write_text("abc")
    assert main(["serve", "--checkpoint", app_checkpoint, "--token-file", str(tmp_path / "short")]) == 2
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    proc, url = start(["--checkpoint", app_checkpoint, "--token-file", str(token)])
    try:
        out = tmp_path / "t.safetensors"
        assert main(["run", "--server", url, "--token-ids", "1,2,3", "--out", str(out)]) == 2
        assert "needs its token" in capsys.readouterr().err and not out.exists()
        assert main(["run", "--server", url, "--token-file", str(token), "--token-ids", "1,2,3", "--out", str(out)]) == 0
    finally:
        started = time.monotonic()
        log = stop(proc)
        assert proc.returncode == 0 and time.monotonic() - started < 15, log  # SIGTERM: a clean, prompt exit


def test_a_rank_that_dies_ends_the_server(two_rank_server):
    """Last in the module: it ends the module's server."""
    proc, url = two_rank_server
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    rank1 = next(p for p in workers if "RANK=1\0" in Path(f"/proc/{p}/environ").read_text(errors="replace"))
    os.kill(int(rank1), signal.SIGKILL)
    started = time.monotonic()
    proc.wait(60)
    assert time.monotonic() - started < 60 and proc.returncode != 0
