"""The app in a shared deployment: every path field (the checkpoint and atlas directories) confined to
ANATOMY_CHECKPOINT_ROOTS and telling nothing about the server, nor an unpacked upload's directory;
names drawn as text and kept per session; no server path in a downloaded trace; trace files bounded
in size, no tracebacks in the browser, and traces with NaN or infinities drawn with a warning
instead of crashing a page."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
import shutil
import tempfile
import zipfile
from pathlib import Path

import pytest
from streamlit import config as st_config
from streamlit.testing.v1 import AppTest

from app.core import pages
from app.core.markup import JOINER
from app.core.traces import store
from app.topics import atlas as atlas_topic
from app.topics.router import moe_blocks
from model.config import ModelArgs
from tests.app.apptest import APP, TIMEOUT, messages, start
from tracing.trace import Trace

REPO = Path(__file__).resolve().parents[2]
REAL = ModelArgs.from_file(REPO / "assets" / "configs" / "config_671B_hf.json")
PAGES = [p.name for p in pages.PAGES]
SECRET = "s3cr3t-4f1d"
needs_atlas = pytest.mark.skipif(not (atlas_topic.BUNDLED / "summary.json").is_file(), reason="assets/demo_atlas is not built")


def everything_shown(at: AppTest) -> str:
    kinds = ("error", "warning", "info", "caption", "markdown", "exception", "code", "text")
    return " ".join(messages(at.get(kind)) for kind in kinds)


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    return start(monkeypatch, app_checkpoint)


def shown_trace(at: AppTest):
    entry = store().get(at.session_state["trace_key"])
    assert entry is not None
    return entry.trace


def open_directory(at: AppTest, path: str) -> AppTest:
    at.radio(key="source").set_value("dir").run()
    return at.text_input(key="ckpt_dir").set_value(path).run()


def upload(at: AppTest, data: bytes, name: str) -> AppTest:
    at.radio(key="source").set_value("upload").run()
    return at.file_uploader(key="upload").set_value((name, data, "application/octet-stream")).run()


# --- the checkpoint field ------------------------------------------------------------------------------
@pytest.fixture()
def roots(tmp_path, tiny_checkpoint):
    """An allowed root holding a checkpoint, and outside it another checkpoint, a symlink to that one
    from inside the root, and a plain file."""
    allowed = tmp_path / "allowed"
    shutil.copytree(tiny_checkpoint, allowed / "tiny")
    outside = shutil.copytree(tiny_checkpoint, tmp_path / "outside" / "tiny")
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    (allowed / "loop").symlink_to(allowed / "loop")
    (tmp_path / "notes.txt").write_text(SECRET)
    return allowed, outside


def test_only_checkpoints_under_the_roots_open_and_refusals_read_alike(app_checkpoint, monkeypatch, tmp_path, roots):
    allowed, outside = roots
    at = start(monkeypatch, app_checkpoint, ANATOMY_CHECKPOINT_ROOTS=str(allowed))
    assert not at.error, messages(at.error)  # the bundled (or default) checkpoint is always allowed
    before = at.session_state["trace_key"]
    refused = {
        "an existing checkpoint outside": str(outside),
        "a missing directory outside": str(tmp_path / "nowhere"),
        "a missing directory inside": str(allowed / "nowhere"),
        "a symlink out of the root": str(allowed / "link"),
        "'..' out of the root": f"{allowed}/../outside/tiny",
        "a file outside": str(tmp_path / "notes.txt"),
        "a system directory": "/etc",
        "the home directory": "~",
        "a symlink loop inside": str(allowed / "loop"),
        "a NUL byte": f"{allowed}/tiny\0/..",
    }
    shown = {}
    for what, path in refused.items():
        open_directory(at, path)
        assert not at.exception, (what, [e.value for e in at.exception])
        shown[what] = messages(at.error)
        assert "blocks, d =" not in messages(at.caption), what  # nothing was loaded
        assert at.session_state["trace_key"] == before, what
    assert len(set(shown.values())) == 1, shown  # existing or not, file or directory: the same words
    message = next(iter(shown.values()))
    assert "Checkpoint not loaded" in message and "not a loadable checkpoint under the allowed roots" in message
    assert str(tmp_path) not in message and SECRET not in message

    open_directory(at, str(allowed / "tiny"))
    assert "Checkpoint not loaded" not in messages(at.error)
    assert "tiny: 3 blocks, d =" in messages(at.caption)


@pytest.mark.parametrize(
    "config",
    [
        json.dumps({**REAL.to_hf(), "model_type": SECRET}),
        "{not json " + SECRET,
        json.dumps({**REAL.to_hf(), "hidden_size": SECRET}),
        json.dumps(REAL.to_hf()),  # no index, no shards
    ],
    ids=["model_type", "not-json", "bad-value", "no-weights"],
)
def test_errors_under_the_roots_do_not_quote_the_files(app_checkpoint, monkeypatch, tmp_path, caplog, config):
    """What a config holds stays on the server: the user sees the generic refusal, the log says why."""
    allowed = tmp_path / "allowed"
    (allowed / "broken").mkdir(parents=True)
    (allowed / "broken" / "config.json").write_text(config)
    at = start(monkeypatch, app_checkpoint, ANATOMY_CHECKPOINT_ROOTS=str(allowed))
    with caplog.at_level(logging.WARNING, logger="app"):
        open_directory(at, str(allowed / "broken"))
    assert not at.exception
    assert "not a loadable checkpoint under the allowed roots" in messages(at.error)
    assert SECRET not in everything_shown(at) and str(allowed) not in messages(at.error)
    assert "broken" in caplog.text and ("config" in caplog.text or "index" in caplog.text)


# --- the atlas directory and the zipped atlas --------------------------------------------------------------
def open_atlas(at: AppTest, path: str) -> AppTest:
    at.sidebar.radio(key="atlas_source").set_value("dir").run()
    return at.sidebar.text_input(key="atlas_dir").set_value(path).run()


def zipped(files: dict[str, bytes]) -> bytes:
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
    return archive.getvalue()


@needs_atlas
def test_atlas_directories_under_the_roots_refuse_alike(app_checkpoint, monkeypatch, tmp_path, caplog):
    """The atlas field is confined as the checkpoint field is: nothing outside the roots opens, and a
    refusal does not tell a missing directory from a file, a system directory or a file's contents."""
    allowed = tmp_path / "allowed"
    shutil.copytree(atlas_topic.BUNDLED, allowed / "atlas")
    outside = shutil.copytree(atlas_topic.BUNDLED, tmp_path / "outside" / "atlas")
    (allowed / "link").symlink_to(outside, target_is_directory=True)
    (allowed / "garbled").mkdir()
    (allowed / "garbled" / "summary.json").write_bytes(b"\xff\xfe" + SECRET.encode())
    (allowed / "empty").mkdir()
    (tmp_path / "notes.txt").write_text(SECRET)
    at = start(monkeypatch, app_checkpoint, "views/atlas.py", ANATOMY_CHECKPOINT_ROOTS=str(allowed))
    refused = {
        "a system directory": "/etc",
        "a missing directory": "/nonexistent",
        "an atlas outside": str(outside),
        "a symlink out of the root": str(allowed / "link"),
        "'..' out of the root": f"{allowed}/../outside/atlas",
        "a file outside": str(tmp_path / "notes.txt"),
        "a non-UTF-8 summary inside": str(allowed / "garbled"),
        "no summary inside": str(allowed / "empty"),
        "a missing directory inside": str(allowed / "nowhere"),
    }
    shown = {}
    with caplog.at_level(logging.WARNING, logger="app"):
        for what, path in refused.items():
            open_atlas(at, path)
            assert not at.exception, (what, [e.value for e in at.exception])
            shown[what] = messages(at.error)
            assert not at.get("plotly_chart"), what  # nothing opened
    assert len(set(shown.values())) == 1, shown
    message = next(iter(shown.values()))
    assert "Atlas not opened" in message and "not an atlas directory under the allowed roots" in message
    assert str(tmp_path) not in message and SECRET not in everything_shown(at)
    assert "garbled" in caplog.text and "/etc" in caplog.text  # the reasons are in the server log

    open_atlas(at, str(allowed / "atlas"))
    assert not at.error, messages(at.error)
    assert at.get("plotly_chart")


@needs_atlas
def test_a_zipped_atlas_error_names_the_archive_not_the_server(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint, "views/atlas.py")
    at.sidebar.radio(key="atlas_source").set_value("upload").run()
    for files in ({"summary.json": b"\xff\xfe not utf-8"}, {"summary.json": b'{"format": "other"}'}):
        data = ("mine.zip", zipped(files), "application/zip")
        at.sidebar.file_uploader(key="atlas_upload").set_value(data).run()
        assert not at.exception
        message = messages(at.error)
        assert "Atlas not opened" in message and "mine.zip" in message, message
        assert tempfile.gettempdir() not in message and "atlas-" not in message, message


# --- names are text, kept per session ----------------------------------------------------------------------
HOSTILE_NAME = (
    "![x](http://127.0.0.1:9/x.png) [link](http://example.com) :red[red] **bold** _it_ $x^2$ <b>b</b> "
    ":smile: `code` ~~gone~~ www.example.com a@example.com # | \\ .safetensors"
)


def unescaped(markdown: str) -> str:
    """The text a Markdown source draws when its only markup is backslash escapes (and word joiners)."""
    return re.sub(r"\\(.)", r"\1", markdown.replace(JOINER, ""))


def sidebar_caption(at: AppTest) -> str:
    return next(str(c.value) for c in at.sidebar.caption if str(c.value).startswith("Showing"))


def page_badges(at: AppTest) -> str:
    return next(str(m.value) for m in at.markdown if ":gray-badge[:material/memory:" in str(m.value))


def test_an_uploaded_name_is_drawn_as_text_and_only_in_its_session(app_checkpoint, monkeypatch):
    """The sidebar and the page badge show the name as typed, escaped (the browser test renders it); a
    second session uploading the same bytes under another name sees its own name, not the first's."""
    first = start(monkeypatch, app_checkpoint)
    data = shown_trace_bytes(first)
    upload(first, data, HOSTILE_NAME)
    assert not first.error, messages(first.error)
    for source in (sidebar_caption(first), page_badges(first)):
        assert HOSTILE_NAME not in source  # not as raw Markdown
        assert HOSTILE_NAME in unescaped(source)

    second = AppTest.from_file(APP, default_timeout=TIMEOUT).run()  # another browser session, the same store
    upload(second, data, "mine.safetensors")
    assert second.session_state["trace_key"] == first.session_state["trace_key"]  # one entry, shared
    assert "trace file mine.safetensors" in messages(second.sidebar.caption)
    assert "127.0.0.1" not in everything_shown(second) and "bold" not in everything_shown(second)
    first.run()
    assert "mine.safetensors" not in everything_shown(first)
    assert HOSTILE_NAME in unescaped(sidebar_caption(first))


def shown_trace_bytes(at: AppTest) -> bytes:
    return store().get(at.session_state["trace_key"]).trace_bytes()


# --- downloads ----------------------------------------------------------------------------------------------
def test_a_downloaded_trace_holds_no_server_path(app_checkpoint, monkeypatch, tmp_path, tiny_checkpoint):
    """What the Export page serves for a trace made here names the checkpoint as the sidebar does."""
    private = shutil.copytree(tiny_checkpoint, tmp_path / "srv-private-9f3" / "tiny")
    at = start(monkeypatch, app_checkpoint)
    open_directory(at, str(private))
    at.text_area(key="prompt").set_value("1, 17, 42")  # the tiny checkpoint has no tokenizer
    at.button(key="run").click().run()
    assert not at.error, messages(at.error)
    assert at.session_state["trace_key"].checkpoint == str(private)
    data = shown_trace_bytes(at.switch_page("views/export.py").run())
    assert b"srv-private-9f3" not in data and str(tmp_path).encode() not in data
    trace = Trace.from_bytes(data)
    assert trace.extra["checkpoint"] == "tiny"
    assert not any("srv-private-9f3" in value for value in trace.metadata().values())


# --- numbers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["0:²", "²:1", "1:³,0:1"])
def test_a_digit_int_does_not_read_is_one_error_line(app_checkpoint, monkeypatch, text):
    """'²' is a digit to str.isdigit() and not to int(): typed as a head or an expert, it is refused in words."""
    at = start(monkeypatch, app_checkpoint, "views/interventions.py")
    at.text_input(key="iv_head_text").set_value(text)
    at.button(key="iv_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Not run" in messages(at.error) and "--ablate-heads" in messages(at.error), messages(at.error)
    assert "could not be drawn" not in messages(at.error)


# --- trace files --------------------------------------------------------------------------------------------
def test_a_trace_file_over_the_limit_is_not_read(app_checkpoint, monkeypatch):
    at = start(monkeypatch, app_checkpoint, ANATOMY_MAX_UPLOAD_MB="0.01")
    before = at.session_state["trace_key"]
    data = store().get(before).trace_bytes()
    assert len(data) > 0.01 * 2**20
    upload(at, data, "big.safetensors")
    assert not at.exception
    assert "Trace file not opened" in messages(at.error) and "more than the 0.01 MiB" in messages(at.error)
    assert "big.safetensors" in messages(at.error)
    assert at.session_state["trace_key"] == before  # the last trace stays on show


def test_streamlit_config_hides_error_details_and_bounds_uploads(monkeypatch):
    """As Streamlit itself reads .streamlit/config.toml: "none", since false would mean "stacktrace"."""
    monkeypatch.chdir(REPO)
    st_config.get_config_options(force_reparse=True)
    here = str(REPO / ".streamlit" / "config.toml")
    assert st_config.get_option("client.showErrorDetails") == st_config.ShowErrorDetailsConfigOptions.NONE.value
    assert st_config.get_where_defined("client.showErrorDetails") == here
    assert st_config.get_where_defined("server.maxUploadSize") == here
    assert 0 < st_config.get_option("server.maxUploadSize") <= 1024


# --- uncaught errors ------------------------------------------------------------------------------------------
def _script_with_a_bug():
    import streamlit as st

    from app.ui import widgets

    def broken() -> None:
        st.markdown("before the bug")
        raise KeyError("s3cr3t-4f1d in /srv/private/config.json")

    widgets.guarded(broken, "The page Broken")
    st.markdown("after the page")


def test_an_uncaught_error_is_one_line_and_its_details_go_to_the_log(caplog):
    with caplog.at_level(logging.ERROR, logger="app"):
        at = AppTest.from_function(_script_with_a_bug, default_timeout=TIMEOUT).run()
    assert not at.exception, [e.value for e in at.exception]
    assert len(at.error) == 1 and "The page Broken could not be drawn" in messages(at.error)
    assert SECRET not in everything_shown(at) and "/srv/private" not in everything_shown(at)
    assert [m.value for m in at.markdown] == ["before the bug", "after the page"]  # the rest of the app still runs
    assert SECRET in caplog.text and "Traceback" in caplog.text


# --- non-finite traces -------------------------------------------------------------------------------------
def with_values(trace, changes: dict[str, tuple[tuple, float]]):
    """The trace with ``changes`` (site -> (index, value)) written into copies of its tensors."""
    tensors = dict(trace.tensors)
    for name, (index, value) in changes.items():
        tensor = tensors[name].clone()
        tensor[index] = value
        tensors[name] = tensor
    return dataclasses.replace(trace, tensors=tensors)


def test_nan_in_the_router_warns_and_every_page_renders(app):
    trace = shown_trace(app)
    assert (trace["layers.0.attn.indexer.scores"] == float("-inf")).any()  # masked keys: expected, not flagged
    assert not app.warning, messages(app.warning)
    block = moe_blocks(trace)[0]
    nan = float("nan")  # a NaN score spreads to the token's weights, as in a model that overflowed
    gate = {f"layers.{block}.ffn.gate.{site}": ((3,), nan) for site in ("scores", "biased_scores", "topk_weights")}
    upload(app, with_values(trace, gate).to_bytes(), "nan.safetensors")
    assert not app.error, messages(app.error)
    app.selectbox(key="block").set_value(block).run()
    for page in PAGES:
        app.switch_page(f"views/{page}.py").run()
        assert not app.exception, (page, [e.value for e in app.exception])
        assert not app.error, (page, messages(app.error))
        assert f"first in `layers.{block}.ffn.gate.scores` at position 3" in messages(app.warning), page
        if page not in ("export", "interventions", "attribution", "patching"):  # these run the model; the upload has none
            assert app.get("plotly_chart"), page
    app.switch_page("views/router.py").run()
    assert any("router scores" in str(s.value) for s in app.subheader)


@pytest.mark.parametrize(
    ("changes", "first"),
    [
        (
            {"layers.2.resid_post": ((1, 0), float("nan")), "layers.1.resid_mid": ((5, 7), float("nan"))},
            "layers.1.resid_mid` at position 5",
        ),
        (
            {"layers.1.resid_pre": ((4, 0), float("-inf")), "layers.1.attn.probs_mean": ((2, 0), float("nan"))},
            "layers.1.resid_pre` at position 4",
        ),
        ({"logits.last": ((0,), float("inf"))}, "logits.last`:"),
    ],
    ids=["nan-stream", "-inf-stream", "inf-logits"],
)
def test_the_warning_names_the_first_site_in_the_computation(app, changes, first):
    trace = shown_trace(app)
    upload(app, with_values(trace, changes).to_bytes(), "bad.safetensors")
    app.switch_page("views/residual.py").run()
    assert not app.exception and not app.error, messages(app.error)
    assert "This trace holds non-finite values" in messages(app.warning)
    assert first in messages(app.warning), messages(app.warning)
    assert app.get("plotly_chart")


def test_a_crafted_trace_claiming_a_huge_model_is_one_error_line(app):
    """A 1.5 KB file whose config claims two million blocks: refused at once, the shown trace stays."""
    import time

    from safetensors.torch import save

    trace = shown_trace(app)
    metadata = trace.metadata()
    metadata["config"] = json.dumps({**json.loads(metadata["config"]), "n_layers": 2_000_000})
    data = save({"tokens": trace["tokens"].contiguous()}, metadata=metadata)
    before = app.session_state["trace_key"]
    started = time.perf_counter()
    upload(app, data, "huge.safetensors")
    assert time.perf_counter() - started < 10
    assert not app.exception
    assert "n_layers must be at most" in messages(app.error)
    assert app.session_state["trace_key"] == before
