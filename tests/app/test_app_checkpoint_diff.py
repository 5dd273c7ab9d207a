"""The Interventions page's other choice: the prompt on another checkpoint of the same tokenizer,
compared block by block (tracing.analyses.diff), run headless with AppTest on the bundled demo (or
the tiny dev checkpoint while assets/demo is absent)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from model.checkpoint import SafetensorsSource, save_checkpoint
from model.synthetic import SyntheticSource
from tests.app.apptest import messages, start
from tests.devcheckpoint import train_tokenizer
from tracing.cli.loading import resolve_checkpoint

PAGE = "views/interventions.py"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="module")
def reseeded(app_checkpoint, tmp_path_factory) -> Path:
    """The app's checkpoint with other (synthetic) weights and the same tokenizer."""
    directory = resolve_checkpoint(app_checkpoint)
    args = SafetensorsSource(directory).args
    source = SyntheticSource(args, seed=7)
    files = {name: directory / name for name in TOKENIZER_FILES if (directory / name).is_file()}
    target = tmp_path_factory.mktemp("reseeded") / "other"
    return save_checkpoint({n: source.load(n) for n in source.specs()}, args, target, extra_files=files)


def compare_with(at: AppTest, path: str) -> AppTest:
    at.radio(key="iv_compare").set_value("checkpoint").run()
    at.text_input(key="iv_other_dir").set_value(path).run()
    at.button(key="iv_other_run").click().run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.get("metric")}


def titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec).get("layout", {}).get("title", {}).get("text", "") for c in at.get("plotly_chart")]


def test_another_checkpoint_is_compared_block_by_block(app_checkpoint, monkeypatch, reseeded):
    at = start(monkeypatch, app_checkpoint, PAGE)
    assert at.radio(key="iv_compare").value == "interventions" and at.button(key="iv_run")
    compare_with(at, str(resolve_checkpoint(app_checkpoint)))  # itself: nothing differs
    assert not at.error, messages(at.error)
    shown = metrics(at)
    assert shown["Top-1 agreement"] == "100%" and shown["First block that differs"] == "none"
    assert shown["Next-token KL, mean"] == "0 nats"
    compare_with(at, str(reseeded))
    assert not at.error, messages(at.error)
    shown = metrics(at)
    assert shown["First block that differs"] == "block 0" and shown["Next-token KL, mean"] != "0 nats"
    assert any("block by block" in t for t in titles(at)), titles(at)
    labels = [b.label for b in at.get("download_button")]
    assert "All diff tables (CSV, zip)" in labels and labels.count("CSV") >= 5
    frames = [d.value for d in at.dataframe]
    blocks = frames[0]  # the per-block table comes first
    assert len(blocks) == SafetensorsSource(reseeded).args.n_layers and (blocks["rel_l2_mean"] > 0).all()
    at.radio(key="iv_compare").set_value("interventions").run()  # back: the interventions' controls
    assert not at.exception and at.button(key="iv_run")


def test_a_bad_path_or_another_tokenizer_is_an_error(app_checkpoint, monkeypatch, reseeded, tmp_path):
    other = shutil.copytree(reseeded, tmp_path / "retokenized")
    texts = ["a completely different corpus of words " * 30, "nothing like the first one at all"]
    train_tokenizer(other, texts, SafetensorsSource(reseeded).args.vocab_size, ["<bos>", "<eos>"])
    at = start(monkeypatch, app_checkpoint, PAGE)
    compare_with(at, str(other))
    assert "Not compared" in messages(at.error) and "the checkpoints' tokenizers differ" in messages(at.error)
    assert not at.get("metric")
    compare_with(at, str(tmp_path / "nowhere"))
    assert "no such directory" in messages(at.error)


def test_the_field_is_confined_under_the_roots(app_checkpoint, monkeypatch, reseeded, tmp_path):
    allowed = tmp_path / "allowed"
    shutil.copytree(reseeded, allowed / "other")
    at = start(monkeypatch, app_checkpoint, PAGE, ANATOMY_CHECKPOINT_ROOTS=str(allowed))
    compare_with(at, str(reseeded))  # outside the roots
    message = messages(at.error)
    assert "not a loadable checkpoint under the allowed roots" in message and str(reseeded) not in message
    compare_with(at, str(allowed / "other"))
    assert not at.error, messages(at.error)
    assert metrics(at)["Top-1 agreement"]
