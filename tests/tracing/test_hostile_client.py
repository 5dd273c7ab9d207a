"""A model server the clients cannot trust: one that drips, sends one endless line, a huge /info,
malformed JSON, a 20 MB error, a trace that is no trace. ``Client`` and ``run --server`` answer
each with one line within the read timeout, having read no more than their caps; a token file is
a small regular file of printable ASCII, the same rule for ``serve`` and every client."""

from __future__ import annotations

import os
import stat
import time
import tracemalloc

import pytest

from model import TINY
from tests.tracing.hostile_server import ERROR_BYTES, HUGE, INFO, hostile_server
from tracing.bearer import read_token_file
from tracing.cli.commands import main
from tracing.client import ENV_READ_TIMEOUT, MESSAGE_CHARS, Client, ServerError
from tracing.errors import InputError
from tracing.runner import TraceRequest, run

READ_TIMEOUT = 0.5
TOKEN = "a-token-of-sixteen-or-more"
EXPECTED = {  # mode: what the one line says
    "drip": "sent too little to go on for 0.5 s",
    "drip_headers": "did not answer in time",
    "drip_info_headers": "did not answer in time",
    "huge_line": "a line longer than 65,536 bytes",
    "malformed": "not JSON: this is not JSON",
    "wrong_types": "malformed progress",
    "error_20mb": "the server says: the model ran out of xaaa",
    "refusal_20mb": "the server says: your request is xaaa",
    "not_safetensors": "the server's trace cannot be read",
    "petabyte_trace": "a trace of 1,000,000,000,000,000 bytes, more than this request can make",
    "huge_info": "larger than 1,048,576 bytes",
    "malformed_info": "is not JSON",
    "wrong_info": "'ranks' is not int",
}
SENT_IN_FULL = {"huge_line": HUGE, "error_20mb": ERROR_BYTES, "refusal_20mb": ERROR_BYTES, "huge_info": HUGE}


@pytest.fixture(scope="module")
def server():
    with hostile_server() as hostile:
        yield hostile


def one_line(message: str, mode: str) -> None:
    assert EXPECTED[mode] in message, message
    assert "\n" not in message and len(message) < MESSAGE_CHARS + 200, message


@pytest.mark.parametrize("mode", list(EXPECTED))
def test_the_client_answers_a_hostile_server_with_one_line_and_bounded_memory(server, mode):
    server.mode = mode
    # the short timeout where the server drips; elsewhere one a busy machine's server thread meets
    timeout = READ_TIMEOUT if mode.startswith("drip") else 5.0
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(ServerError) as caught, Client(server.url, read_timeout=timeout) as client:
            client.trace(token_ids=[1, 2, 3])
        seconds = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    one_line(str(caught.value), mode)
    assert seconds < timeout + 2, seconds
    assert peak < 8 * 2**20, peak  # the caps' bytes, not the server's 20 or 200 MB
    if mode in SENT_IN_FULL:
        assert server.sent < SENT_IN_FULL[mode] / 2, server.sent  # it stopped reading: the server could not send it all


@pytest.mark.parametrize("mode", ["drip", "drip_headers", "huge_line", "malformed", "error_20mb", "not_safetensors", "huge_info"])
def test_run_on_a_hostile_server_is_one_line_and_status_2(server, mode, monkeypatch, tmp_path, capsys):
    server.mode = mode
    monkeypatch.setenv(ENV_READ_TIMEOUT, str(READ_TIMEOUT))
    out = tmp_path / "t.safetensors"
    started = time.monotonic()
    code = main(["run", "--server", server.url, "--token-ids", "1,2,3", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: ") and not out.exists(), (code, err)
    assert time.monotonic() - started < READ_TIMEOUT + 2
    assert EXPECTED[mode] in err or mode == "not_safetensors" and "not a readable trace file" in err, err


@pytest.mark.parametrize("mode", ["drip", "error_20mb"])
def test_patching_on_a_hostile_server_is_one_line_and_status_2(server, mode, monkeypatch, tmp_path, capsys):
    server.mode = mode
    monkeypatch.setenv(ENV_READ_TIMEOUT, str(READ_TIMEOUT))
    argv = ["patching", "--server", server.url, "--clean-ids", "1,2,3", "--corrupt-ids", "1,2,4", "--out", str(tmp_path / "p")]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and EXPECTED[mode] in err and not (tmp_path / "p").exists(), (code, err)


def test_a_server_that_works_longer_than_the_read_timeout_is_waited_for(tiny_model, server):
    """Lines every 0.2 s for 1.4 s (progress, a heartbeat, a blank line) against a 0.5 s read timeout:
    the trace arrives, each event seen once."""
    server.mode, server.trace = "working", run(tiny_model, TraceRequest(token_ids=(1, 2, 3))).to_bytes()
    events = []
    started = time.monotonic()
    with Client(server.url, read_timeout=READ_TIMEOUT) as client:
        trace = client.trace(token_ids=[1, 2, 3], on_progress=events.append)
    assert time.monotonic() - started > 2 * READ_TIMEOUT and trace.token_ids == [1, 2, 3]
    assert [e["progress"]["block"] for e in events if "progress" in e] == list(range(1, 8))
    assert {"queued": 1} in events and {"heartbeat": 2} in events


def test_health_is_asked_with_the_connect_timeout(server):
    """/health is a status with no work behind it: the sidebar asks it on every rerun, so a server
    that drips it costs the connect timeout, not the read timeout."""
    server.mode = "drip"
    started = time.monotonic()
    with pytest.raises(ServerError, match="did not answer in time"), Client(server.url, timeout=0.3, read_timeout=30) as client:
        client.health()
    assert time.monotonic() - started < 1.5


def test_the_timeouts_are_settable_and_checked(server, monkeypatch):
    monkeypatch.setenv(ENV_READ_TIMEOUT, "0.5")
    assert Client(server.url).read_timeout == 0.5 and Client(server.url, read_timeout=2).read_timeout == 2
    monkeypatch.setenv(ENV_READ_TIMEOUT, "inf")
    with pytest.raises(InputError, match="ANATOMY_SERVER_READ_TIMEOUT"):
        Client(server.url)


def test_the_trace_cap_admits_every_trace_the_request_can_make(tiny_model, server):
    """The cap on the announced size is no guess that refuses real traces: a trace with generation,
    attribution and the contribution graph at the server's most tokens fits under it."""
    request = TraceRequest(token_ids=tuple(range(1, 57)), generate=8, attribute=True, record=("default", "flow"))
    data = run(tiny_model, request).to_bytes()
    server.mode = "good"
    with Client(server.url) as client:
        cap = client.trace_cap(request)
        assert len(data) <= cap < client.max_trace_bytes
        assert client.trace_cap(TraceRequest(token_ids=(1, 2, 3))) < cap  # the request's own size, not one cap for all
    assert INFO["config"] == TINY.to_hf()


# --- token files ---------------------------------------------------------------------------------


def private(path, text: str | bytes):
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    path.chmod(0o600)
    return path


def test_a_token_file_is_a_small_regular_file_of_printable_ascii(tmp_path, capsys):
    assert read_token_file(private(tmp_path / "good", TOKEN + "\n")) == TOKEN
    assert capsys.readouterr().err == ""  # a private file: no warning
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = {
        "/dev/zero": "not a regular file",
        str(fifo): "not a regular file",  # refused at once: nobody writes to it, and nothing blocks
        str(tmp_path): "is a directory",
        str(private(tmp_path / "large", "t" * 5000)): "more than 4,096 bytes",
        str(private(tmp_path / "accents", "a-token-of-sixteen-é".encode())): "non-ASCII",
        str(private(tmp_path / "control", TOKEN + "\x07")): "printable ASCII",
        str(private(tmp_path / "short", "abc")): "at least 16",
        str(tmp_path / "missing"): "cannot read it",
    }
    for path, reason in refused.items():
        with pytest.raises(InputError, match=reason):
            read_token_file(path)


def test_a_token_given_in_python_follows_the_same_rule(server):
    with pytest.raises(InputError, match="printable ASCII"):
        Client(server.url, token="a-token-of-sixteen-é")


def test_a_world_readable_token_file_warns_in_one_line(tmp_path, capsys):
    path = private(tmp_path / "token", TOKEN)
    path.chmod(0o644)
    assert read_token_file(path, "ANATOMY_SERVER_TOKEN_FILE") == TOKEN
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "every user of this machine can read it" in err and "ANATOMY_SERVER_TOKEN_FILE" in err
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # said, not changed


@pytest.mark.parametrize("command", ["serve", "run"])
def test_serve_and_the_clients_refuse_the_same_token_files(command, tmp_path, capsys, server):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    source = (
        ["--checkpoint", "demo"]
        if command == "serve"
        else ["--server", server.url, "--token-ids", "1,2", "--out", str(tmp_path / "t.safetensors")]
    )
    for path in ("/dev/zero", str(fifo), str(private(tmp_path / "accents", "a-token-of-sixteen-é".encode()))):
        started = time.monotonic()
        assert main([command, *source, "--token-file", path]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"error: --token-file {path}: "), err
        assert time.monotonic() - started < 5
