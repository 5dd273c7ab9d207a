"""Training a dictionary on the demo: it learns, it resumes where it stopped, and the command refuses bad input."""

from __future__ import annotations

import json

import pytest
import torch

from tracing.atlas.corpus import Source
from tracing.cli.commands import main
from tracing.cli.loading import DEMO, open_checkpoint
from tracing.dictionary import Dictionary, load, train
from tracing.dictionary.buffer import ActivationBuffer
from tracing.dictionary.sources import LocalModel
from tracing.dictionary.train import STATE, Settings, Trainer, TrainJob

SAMPLE = DEMO / "heldout_sample.txt"
# about 1200 tokens: 19 sequences of 64 in 5 batches, the 4th held out; 2 x 20 steps of 48 rows;
# a buffer of 64 KiB (64 rows) is a phase, and a state written, per batch
TINY = dict(features=32, k=4, seq_len=64, batch_size=4, rows_per_step=48, heldout=0.25, dead_tokens=200, epochs=2)
TINY.update(buffer_bytes=1 << 16)

pytestmark = pytest.mark.skipif(not (DEMO / "config.json").is_file(), reason="assets/demo is not there")


@pytest.fixture(scope="module")
def demo():
    return open_checkpoint("demo")


def job(demo, out, **settings) -> TrainJob:
    s = Settings(site="layers.1.resid_post", **{**TINY, **settings})
    return TrainJob([Source(SAMPLE)], demo.tokenizer, demo.model.args, out, s, label="demo")


@pytest.fixture(scope="module")
def trained(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("dict") / "sae"
    return out, train(demo, [SAMPLE], out, site="layers.1.resid_post", **TINY)  # the Python API: job(demo, out).run(demo)


def test_training_learns_and_saves_what_it_reports(trained, demo):
    out, report = trained
    assert report["loss_end"] < 0.9 * report["loss_start"]  # the last ten steps' mean against the first ten's
    assert json.loads((out / "report.json").read_text()) == report
    d = load(out)
    assert (d.site, d.kind, d.n_features, d.k) == ("layers.1.resid_post", "sae", 32, 4)
    assert torch.allclose(d.W_dec.norm(dim=1), torch.ones(32), atol=1e-5)
    assert report["l0"] <= 4 and 0 <= report["dead_share"] < 1
    # the same held-out rows through a dictionary that has not trained: far worse
    untrained = Dictionary("sae", "layers.1.resid_post", demo.model.args.dim, 32, 4).init_weights(
        torch.Generator().manual_seed(0)
    )
    j = job(demo, out)
    baseline = j.evaluate(LocalModel(demo, "sae", d.site, 1, True), untrained)
    assert report["variance_explained"] > baseline["variance_explained"] + 0.2
    assert report["spliced_loss"] < baseline["spliced_loss"]
    assert report["clean_loss"] == pytest.approx(baseline["clean_loss"])


def test_an_interrupted_run_continues_to_the_same_dictionary(trained, demo, tmp_path, monkeypatch):
    whole, want = trained
    out = tmp_path / "again"
    writes = []

    def stop_after_third(self, trainer, progress):
        original(self, trainer, progress)
        writes.append(progress["step"])
        if len(writes) == 3:
            raise KeyboardInterrupt

    original = TrainJob._write_state
    monkeypatch.setattr(TrainJob, "_write_state", stop_after_third)
    with pytest.raises(KeyboardInterrupt):
        job(demo, out).run(demo)
    monkeypatch.setattr(TrainJob, "_write_state", original)
    assert (out / STATE).is_file() and 0 < writes[-1] < want["steps"]
    got = job(demo, out).run(demo)
    assert got["steps"] == want["steps"] and got["variance_explained"] == want["variance_explained"]
    a, b = load(out), load(whole)
    for name, p in a.named_parameters():
        assert torch.equal(p, getattr(b, name)), name
    with pytest.raises(Exception, match="other settings"):
        job(demo, out, seed=1)


def test_the_scales_fold_exactly():
    torch.manual_seed(0)
    for kind, site in (("sae", "layers.1.resid_post"), ("transcoder", "layers.1.ffn")):
        t = Trainer(Settings(site=site, kind=kind, features=16, k=3), 8, 8)
        x, y = torch.randn(64, 8) * 30, torch.randn(64, 8) * 0.2
        t.step_on(x, None if kind == "sae" else y)
        folded = t.dictionary({})
        target_scale = t.scale_out
        assert torch.allclose(folded(x), t.d(x * t.scale_in) / target_scale, atol=1e-4)


def test_the_buffer_gives_every_row_once_shuffled_within_its_bound(tmp_path):
    buffer = ActivationBuffer(tmp_path / "b", 4, 2, max_bytes=1 << 16, chunk_bytes=24 * 100)
    rows = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    for i in range(0, 1000, 70):
        buffer.add(rows[i : i + 70], rows[i : i + 70, :2] * 2)
    assert buffer.rows == 1000 and buffer.bytes_on_disk <= 1000 * 24
    seen = [b for b in buffer.batches(64, torch.Generator().manual_seed(0))]
    x = torch.cat([b[0] for b in seen])
    assert torch.equal(x[:, :2] * 2, torch.cat([b[1] for b in seen]))
    assert sorted(x[:, 0].tolist()) == rows[:, 0].tolist() and not torch.equal(x, rows)
    assert buffer.peak_bytes <= 3 * 100 * 24  # what is pending, or two chunks and a carried remainder
    buffer.clear()
    assert not list((tmp_path / "b").iterdir())


def test_the_command_refuses_bad_input_in_one_line(tmp_path, capsys):
    base = ["dictionary", "train", "--checkpoint", "demo", "--text-file", str(SAMPLE), "--features", "16", "--k", "4"]
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    cases = {
        "blocks": ["--site", "layers.9.resid_post", "--out", str(tmp_path / "a")],
        "a sae reads": ["--site", "layers.1.ffn", "--kind", "sae", "--out", str(tmp_path / "b")],
        "at most the 16": ["--site", "layers.1.resid_post", "--out", str(tmp_path / "c"), "--k", "17"],
        "refusing to write": ["--site", "layers.1.resid_post", "--out", str(tmp_path / "taken")],
        "a transcoder reads": ["--site", "layers.1.resid_post", "--kind", "transcoder", "--out", str(tmp_path / "d")],
    }
    for said, extra in cases.items():
        assert main([*base, *extra]) == 2, said
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and said in err, err
    assert (tmp_path / "taken" / "notes.txt").read_text() == "mine"
