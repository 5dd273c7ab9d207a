"""Hostile paths in the Interventions page's "another checkpoint" field, run headless with AppTest on
the bundled demo: each is refused in one st.error line (no traceback, no server path named under
ANATOMY_CHECKPOINT_ROOTS) before any weight outside the roots is read."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.app.apptest import messages, start
from tests.app.test_app_checkpoint_diff import PAGE, compare_with
from tracing.cli.loading import resolve_checkpoint


@pytest.fixture()
def allowed(app_checkpoint, tmp_path):
    """A root with a copy of the app's checkpoint, a plain file, a copy whose index names shards outside
    it, and outside the root the shards that index points at."""
    source = resolve_checkpoint(app_checkpoint)
    root = tmp_path / "allowed"
    shutil.copytree(source, root / "copy")
    (root / "notes.txt").write_text("not a checkpoint")
    escaping = shutil.copytree(source, root / "escaping")
    outside = shutil.copytree(source, tmp_path / "outside")
    index = escaping / "model.safetensors.index.json"
    if index.is_file():
        spec = json.loads(index.read_text())
        spec["weight_map"] = {name: f"../../outside/{shard}" for name, shard in spec["weight_map"].items()}
        index.write_text(json.dumps(spec))
        for shard in set(json.loads((outside / "model.safetensors.index.json").read_text())["weight_map"].values()):
            (escaping / shard).unlink()
    return root, outside


@pytest.mark.parametrize("case", ["outside", "dot-dot", "a file", "shards outside", "empty"])
def test_a_hostile_path_is_one_error_line(app_checkpoint, monkeypatch, allowed, case):
    root, outside = allowed
    typed = {
        "outside": str(outside),
        "dot-dot": str(root / "copy" / ".." / ".." / "outside"),
        "a file": str(root / "notes.txt"),
        "shards outside": str(root / "escaping"),
        "empty": "   ",
    }[case]
    at = start(monkeypatch, app_checkpoint, PAGE, ANATOMY_CHECKPOINT_ROOTS=str(root))
    compare_with(at, typed)
    shown = messages(at.error)
    assert len(at.error) == 1 and "Not compared" in shown, (case, shown)
    assert "allowed roots" in shown and str(outside) not in shown and not at.get("metric"), shown


def test_a_checkpoint_of_another_shape_is_one_error_line(app_checkpoint, monkeypatch, tiny_checkpoint):
    at = start(monkeypatch, app_checkpoint, PAGE)
    compare_with(at, str(tiny_checkpoint))
    shown = messages(at.error)
    assert len(at.error) == 1 and "different shapes" in shown and not at.get("metric"), shown
