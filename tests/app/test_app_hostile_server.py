"""The app on a model server it cannot trust (tests/tracing/hostile_server.py): a huge or malformed
/info, an answer or its headers that drip, one endless line, a 20 MB error. The sidebar says each in one
``st.error`` of a few hundred characters within the read timeout, and the app goes on."""

from __future__ import annotations

import time

import pytest
from streamlit.testing.v1 import AppTest

from app.core import settings
from app.core.models import _open_server
from tests.app.apptest import APP, messages, raised_nothing
from tests.tracing.hostile_server import hostile_server
from tracing.client import ENV_READ_TIMEOUT, ENV_TIMEOUT, MESSAGE_CHARS

READ_TIMEOUT = 0.5
SAYS = {  # mode: (the sidebar's heading, what its one line says)
    "huge_info": ("Model server not reached.", "is larger than 1,048,576 bytes"),
    "malformed_info": ("Model server not reached.", "is not JSON"),
    "drip": ("Not traced.", "sent too little to go on for 0.5 s"),
    "drip_info_headers": ("Model server not reached.", "did not answer in time"),
    "huge_line": ("Not traced.", "a line longer than 65,536 bytes"),
    "malformed": ("Not traced.", "not JSON: this is not JSON"),
    "error_20mb": ("Not traced.", "the server says: the model ran out of"),
}


@pytest.fixture(scope="module")
def server():
    with hostile_server() as hostile:
        yield hostile


@pytest.mark.parametrize("mode", list(SAYS))
def test_the_sidebar_says_a_hostile_server_in_one_line(server, mode, monkeypatch):
    server.mode = mode
    _open_server.clear()  # the server's /info is asked again, as a new process would
    monkeypatch.setenv(settings.ENV_SERVER, server.url)
    monkeypatch.setenv(ENV_READ_TIMEOUT, str(READ_TIMEOUT))
    monkeypatch.setenv(ENV_TIMEOUT, str(READ_TIMEOUT))  # /health, asked on every rerun, drips too
    started = time.monotonic()
    at = raised_nothing(AppTest.from_file(APP, default_timeout=30).run())
    seconds = time.monotonic() - started
    heading, says = SAYS[mode]
    errors = [str(e.value) for e in at.error]
    assert len(errors) == 1, errors
    text = messages(at.error)
    assert heading in text and says in text, text
    assert "\n" not in errors[0] and len(errors[0]) < MESSAGE_CHARS + 300, errors[0]
    assert seconds < 15, seconds  # the first run imports the app; the server costs a read timeout at most


def test_the_sidebar_says_a_streamed_servers_bytes_per_tier_and_not_what_it_cannot_trust(server):
    server.mode = "streamed"
    model = _open_server(server.url, None)
    assert model.describe()[-1] == "streamed so far: weights 2.0 GB from disk, 0.0 MB from host memory, 0.5 GB kept on the device"
    server.mode = "wrong_streamed"  # strings, a number past any float, a negative count: left unsaid
    assert not any("streamed" in line for line in model.describe())
