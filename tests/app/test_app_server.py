"""The app on a model server (python -m tracing serve, here two ranks under torchrun): with
ANATOMY_SERVER set it opens on the server's model, traces, generates, intervenes and attributes
there, every page draws the server's traces, and the sidebar names the server and its ranks; a
shared deployment reaches only the server it names."""

from __future__ import annotations

import pytest
import torch
from streamlit.testing.v1 import AppTest

from app.core import settings
from tests.app.test_app import APP, TIMEOUT, messages, shown_entry
from tests.app.test_app_generation import checked, generate
from tests.tracing.test_server import start, stop
from tracing.cli.loading import open_checkpoint
from tracing.runner import TraceRequest, run

PROMPT = "The lightning indexer chooses which earlier keys"


@pytest.fixture(scope="module")
def server(app_checkpoint):
    proc, url = start(["--checkpoint", app_checkpoint], ranks=2)
    yield url
    stop(proc)


@pytest.fixture()
def app(server, monkeypatch) -> AppTest:
    monkeypatch.setenv(settings.ENV_SERVER, server)
    return checked(AppTest.from_file(APP, default_timeout=TIMEOUT).run())


def test_the_app_opens_on_the_server_and_traces_there(app, server, app_checkpoint):
    assert app.session_state["source"] == "server" and not app.error, messages(app.error)
    caption = messages(app.sidebar.caption)
    assert f"model server {server}: 2 ranks on cpu" in caption
    assert "model held in memory (its part, " in caption and "a request reads nothing from disk" in caption
    loaded = open_checkpoint(app_checkpoint)
    own = min(loaded.model.args.max_seq_len, settings.max_tokens())  # the demo's 256, not the server's 4,096
    assert f"the server takes prompts of up to {loaded.model.args.max_seq_len:,} tokens" in caption
    assert app.text_area(key="prompt").help == f"Up to {own:,} tokens." and app.number_input(key="gen_tokens").max == own
    entry = shown_entry(app)
    assert entry.key.checkpoint == server
    local = run(loaded.model, TraceRequest(prompt=settings.DEFAULT_PROMPT, record=("default",)), loaded.tokenizer)
    assert torch.equal(entry.trace["tokens"], local["tokens"])
    for name in ("layers.1.ffn.gate.topk_indices", "layers.2.attn.indexer.topk_indices", "next.topk_indices"):
        assert torch.equal(entry.trace[name], local[name]), name


def test_generation_attribution_and_interventions_through_the_server(app, server):
    at = generate(app, 3, PROMPT)
    entry = shown_entry(at)
    assert entry.key.checkpoint == server and entry.trace.extra["generation"]["generated"] == 3
    at = checked(at.switch_page("views/attribution.py").run())
    assert not at.error, messages(at.error)
    assert "is **" in messages(at.markdown)  # "At position P, the logit of ... is **+x.xxxx**"
    at = checked(at.switch_page("views/interventions.py").run())
    at.toggle(key="iv_no_bias").set_value(True).run()
    at = checked(at.button(key="iv_run").click().run())
    assert not at.error, messages(at.error)
    assert at.session_state["iv_result"]["spec"]["no_bias"] == "all"


def test_a_shared_deployment_reaches_only_its_server(server, monkeypatch, tmp_path):
    monkeypatch.setenv(settings.ENV_SERVER, server)
    monkeypatch.setenv(settings.ENV_CHECKPOINT_ROOTS, str(tmp_path))
    at = checked(AppTest.from_file(APP, default_timeout=TIMEOUT).run())
    assert at.text_input(key="server_url").disabled and at.text_input(key="server_url").value == server
    from app.core.models import open_server
    from tracing.errors import InputError

    with pytest.raises(InputError, match="only the model server this deployment names"):
        open_server("http://169.254.169.254/")
