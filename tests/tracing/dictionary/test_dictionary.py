"""The dictionary on disk: SAELens's layout round-trips exactly, and what cannot be one is refused in one line."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import save_file

from model import TINY
from tracing.dictionary import Dictionary, DictionaryError, check_fits, load, save
from tracing.dictionary.dictionary import CFG_NAME, WEIGHTS_NAME


def random_dictionary(kind="sae", site="layers.1.resid_post", d=TINY.dim, n=48, k=4) -> Dictionary:
    d_ = Dictionary(kind, site, d, n, k).init_weights(torch.Generator().manual_seed(3))
    with torch.no_grad():
        d_.b_enc.normal_()
        d_.b_dec.normal_()
    return d_


@pytest.mark.parametrize("kind,site", [("sae", "layers.1.resid_post"), ("transcoder", "layers.1.ffn")])
def test_round_trip_is_exact(tmp_path, kind, site):
    d = random_dictionary(kind, site)
    loaded = load(save(d, tmp_path / kind))
    for name, p in d.named_parameters():
        assert torch.equal(p, getattr(loaded, name)), name
    assert (loaded.kind, loaded.site, loaded.k, loaded.out_site) == (kind, site, 4, d.out_site)
    x = torch.randn(5, TINY.dim)
    acts = loaded.encode(x)
    assert torch.equal(acts, d.encode(x)) and ((acts > 0).sum(-1) <= 4).all()
    assert torch.equal(loaded(x), d(x))
    cfg = json.loads((tmp_path / kind / CFG_NAME).read_text())
    assert cfg["metadata"]["hook_name"] == site and cfg["architecture"] == ("topk" if kind == "sae" else "transcoder")
    check_fits(loaded, TINY)


def test_encode_is_topk_of_relu():
    d = random_dictionary()
    x = torch.randn(3, TINY.dim)
    pre = (x - d.b_dec) @ d.W_enc + d.b_enc
    acts = d.encode(x)
    for row, p in zip(acts, pre, strict=True):
        top = p.topk(4).indices
        assert torch.equal(row[top], p[top].relu()) and (row.count_nonzero() <= 4)


def _refused(tmp_path, mutate) -> str:
    directory = save(random_dictionary(), tmp_path / "d")
    mutate(directory)
    with pytest.raises(DictionaryError) as info:
        load(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_refusals_are_one_line(tmp_path):
    def nan(directory):
        d = load(directory)
        tensors = {n: p.detach().clone() for n, p in d.named_parameters()}
        tensors["W_dec"][2, 3] = float("nan")
        save_file(tensors, directory / WEIGHTS_NAME)

    assert "NaN" in _refused(tmp_path / "nan", nan)

    def huge_header(directory):
        (directory / WEIGHTS_NAME).write_bytes(struct.pack("<Q", 1 << 40) + b"{}")

    assert "header" in _refused(tmp_path / "header", huge_header)

    def wrong_shape(directory):
        cfg = json.loads((directory / CFG_NAME).read_text())
        cfg["d_sae"] = 40
        (directory / CFG_NAME).write_text(json.dumps(cfg))

    assert "shape" in _refused(tmp_path / "shape", wrong_shape)

    def claims_a_million(directory):  # about a GiB of weights claimed: refused by the header, nothing allocated
        cfg = json.loads((directory / CFG_NAME).read_text())
        cfg["d_sae"] = 1 << 20
        (directory / CFG_NAME).write_text(json.dumps(cfg))

    assert "shape" in _refused(tmp_path / "million", claims_a_million)
    assert "no sae_weights" in _refused(tmp_path / "missing", lambda d: (d / WEIGHTS_NAME).unlink())
    assert "no cfg.json" in _refused(tmp_path / "nocfg", lambda d: (d / CFG_NAME).unlink())
    assert "not JSON" in _refused(tmp_path / "badjson", lambda d: (d / CFG_NAME).write_text("{"))

    def foreign_hook(directory):
        cfg = json.loads((directory / CFG_NAME).read_text())
        cfg["metadata"]["hook_name"] = "blocks.3.hook_resid_post"
        (directory / CFG_NAME).write_text(json.dumps(cfg))

    assert "hook_name" in _refused(tmp_path / "hook", foreign_hook)

    def no_k(directory):
        cfg = json.loads((directory / CFG_NAME).read_text())
        del cfg["k"]
        (directory / CFG_NAME).write_text(json.dumps(cfg))

    assert "without k" in _refused(tmp_path / "nok", no_k)

    def huge_width(directory):
        cfg = json.loads((directory / CFG_NAME).read_text())
        cfg["d_sae"] = 1 << 23
        (directory / CFG_NAME).write_text(json.dumps(cfg))

    assert "GiB" in _refused(tmp_path / "wide", huge_width)


def test_wrong_width_or_block_does_not_fit():
    with pytest.raises(DictionaryError, match="wide"):
        check_fits(random_dictionary(d=TINY.dim + 2), TINY)
    with pytest.raises(DictionaryError, match="blocks"):
        check_fits(random_dictionary(site=f"layers.{TINY.n_layers}.resid_post"), TINY)


def test_saelens_round_trip(tmp_path):
    """Both ways through SAELens's own loader and writer (importing sae_lens takes about 11 s: the
    one test that does)."""
    sae_lens = pytest.importorskip("sae_lens")
    from sae_lens import SAE

    x = torch.randn(6, TINY.dim)
    for kind, site in (("sae", "layers.1.resid_post"), ("transcoder", "layers.1.ffn")):
        ours = random_dictionary(kind, site, k=48 if kind == "transcoder" else 4)  # SAELens's transcoder is a ReLU
        theirs = SAE.load_from_disk(save(ours, tmp_path / f"ours-{kind}"))
        assert theirs.cfg.architecture() == ("topk" if kind == "sae" else "transcoder")
        assert theirs.cfg.metadata.hook_name == site
        with torch.no_grad():
            assert torch.allclose(theirs.encode(x), ours.encode(x), atol=1e-5)
            assert torch.allclose(theirs.decode(ours.encode(x)), ours.decode(ours.encode(x)), atol=1e-5)

    cfg = sae_lens.TopKSAEConfig(d_in=TINY.dim, d_sae=40, k=5)
    cfg.metadata.hook_name = "layers.0.resid_mid"
    theirs = sae_lens.TopKSAE(cfg)
    with torch.no_grad():
        theirs.b_enc.normal_()
        theirs.b_dec.normal_()
    theirs.save_model(tmp_path / "theirs")
    ours = load(tmp_path / "theirs")
    assert (ours.kind, ours.site, ours.n_features, ours.k) == ("sae", "layers.0.resid_mid", 40, 5)
    with torch.no_grad():
        assert torch.allclose(ours.encode(x), theirs.encode(x), atol=1e-5)
        assert torch.allclose(ours(x), theirs(x), atol=1e-5)

    cfg = sae_lens.TranscoderConfig(d_in=TINY.dim, d_sae=24, d_out=TINY.dim, apply_b_dec_to_input=False)
    cfg.metadata.hook_name = "layers.2.ffn"
    theirs = sae_lens.Transcoder(cfg)
    theirs.save_model(tmp_path / "theirs-transcoder")
    ours = load(tmp_path / "theirs-transcoder")
    assert (ours.kind, ours.out_site, ours.k) == ("transcoder", "layers.2.ffn_out", 24)  # a ReLU: TopK over all
    with torch.no_grad():
        assert torch.allclose(ours(x), theirs(x), atol=1e-5)


def test_the_bundled_dictionaries_fit_the_demo():
    from tracing.cli.loading import DEMO, REPO

    if not (DEMO / "config.json").is_file():
        pytest.skip("assets/demo is not there")
    from model.checkpoint import SafetensorsSource

    args = SafetensorsSource(DEMO).args
    bundled = REPO / "assets" / "dictionaries"
    found = {}
    for directory in sorted(p for p in bundled.iterdir() if (p / "cfg.json").is_file()):  # pages/ holds their pages
        d = load(directory)
        check_fits(d, args)
        found[d.site] = d.kind
        report = json.loads((directory / "report.json").read_text())
        assert report["site"] == d.site and report["variance_explained"] > 0.3
    assert found == {"layers.1.resid_post": "sae", "layers.2.ffn": "transcoder"}
    assert sum(f.stat().st_size for f in bundled.rglob("*")) <= 5 * 2**20
