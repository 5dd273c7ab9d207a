"""Features in traces: what a run records is its dictionary applied by hand to the recorded site, a
feature edit changes its site by that feature's part and nothing before it, and a dictionary that
does not fit is refused in one line."""

from __future__ import annotations

import pytest
import torch

from model import TINY
from tracing.cli.commands import main
from tracing.dictionary import Dictionary, save
from tracing.errors import InputError
from tracing.runner import TraceRequest, run
from tracing.sites import FEATURES_TOPK
from tracing.tables.frames import features_table
from tracing.trace import Trace

IDS = (5, 17, 300, 2, 9, 44, 123, 7, 88, 61)


def dictionary(kind="sae", site="layers.1.resid_post", n=48, k=4, width=TINY.dim, seed=3) -> Dictionary:
    d = Dictionary(kind, site, width, n, k).init_weights(torch.Generator().manual_seed(seed))
    with torch.no_grad():
        d.b_enc.normal_(0, 0.1, generator=torch.Generator().manual_seed(seed))
    return d


def dense(ids: torch.Tensor, acts: torch.Tensor, n: int) -> torch.Tensor:
    """(T, F) recorded ids and activations as (T, n) activations."""
    out = torch.zeros(ids.shape[0], n)
    kept = ids >= 0
    out[kept.nonzero()[:, 0], ids[kept]] = acts[kept]
    return out


def test_features_in_a_trace_are_the_dictionary_applied_by_hand(tiny_model):
    sae, transcoder = dictionary(), dictionary("transcoder", "layers.2.ffn", n=40, k=20, seed=4)
    request = TraceRequest(
        token_ids=IDS,
        prefill=6,
        record=("layers.1.resid_post", "layers.2.resid_mid", "layers.2.ffn_out"),
        dictionaries=(sae, transcoder),
    )
    trace = Trace.from_bytes(run(tiny_model, request).to_bytes())  # as the file holds it, validated
    x = trace["layers.1.resid_post"]  # the prefill's rows and the decode path's, merged
    ids, acts = trace["layers.1.resid_post.features.top_ids"], trace["layers.1.resid_post.features.top_acts"]
    assert ids.shape == (len(IDS), FEATURES_TOPK) and ((ids >= 0).sum(-1) == sae.k).all()
    by_hand = sae.encode(x)
    torch.testing.assert_close(dense(ids, acts, sae.n_features), by_hand, rtol=0, atol=1e-5)
    assert (acts[:, :-1] >= acts[:, 1:]).all()  # strongest first
    torch.testing.assert_close(trace["layers.1.resid_post.features.error_norm"], (x - sae(x)).norm(dim=-1))
    block = tiny_model.layers[2]  # a transcoder reads the FFN's normed input and predicts its update
    normed = block.ffn_norm(trace["layers.2.resid_mid"], block.dtype)
    t_acts = trace["layers.2.ffn.features.top_acts"]
    top = transcoder.encode(normed).topk(FEATURES_TOPK, dim=-1)  # k=20 active, 16 recorded
    torch.testing.assert_close(t_acts, top.values, rtol=0, atol=1e-5)
    error = (trace["layers.2.ffn_out"] - transcoder(normed)).norm(dim=-1)
    torch.testing.assert_close(trace["layers.2.ffn.features.error_norm"], error)
    assert trace.extra["dictionaries"]["layers.2.ffn"] == {
        "name": "layers.2.ffn",
        "kind": "transcoder",
        "n_features": 40,
        "k": 20,
    }
    table = features_table(trace)
    assert len(table) == len(IDS) * (sae.k + FEATURES_TOPK)
    assert set(table["site"]) == {"layers.1.resid_post", "layers.2.ffn"} and (table["activation"] > 0).all()


def test_a_feature_edit_changes_its_site_by_its_part_and_nothing_before(tiny_model):
    sae = dictionary()
    site = "layers.1.resid_post"
    base = run(tiny_model, TraceRequest(token_ids=IDS, record=("layers.*.resid_post", "layers.*.resid_mid"), dictionaries=(sae,)))
    x = base[site]
    feature = int(base[f"{site}.features.top_ids"][7, 0])  # active at position 7
    acts = sae.encode(x)[:, feature]  # (T,)
    direction = sae.W_dec[feature].detach()
    for edit, change in ((f"{feature}=0", -acts), (f"{feature}*2.5", 1.5 * acts), (f"{feature}+3", torch.full_like(acts, 3.0))):
        spec = {"features": f"{site}:{edit}@6:"}
        edited = run(
            tiny_model,
            TraceRequest(
                token_ids=IDS, record=("layers.*.resid_post", "layers.*.resid_mid"), dictionaries=(sae,), interventions=spec
            ),
        )
        want = change[:, None] * direction  # (T, D): the feature's part of the reconstruction, changed
        torch.testing.assert_close(edited[site][6:] - x[6:], want[6:], rtol=0, atol=1e-5)
        assert torch.equal(edited[site][:6], x[:6])  # not before its positions
        for earlier in ("layers.0.resid_post", "layers.0.resid_mid", "layers.1.resid_mid"):
            assert torch.equal(edited[earlier], base[earlier])  # nor in what comes before it
        assert not torch.equal(edited["layers.2.resid_mid"][6:], base["layers.2.resid_mid"][6:])  # it reaches later blocks
        assert edited.extra["interventions"][0].startswith(f"feature {site}:{feature}")
    with pytest.raises(InputError, match="no dictionary of layers.1.resid_post"):
        run(tiny_model, TraceRequest(token_ids=IDS, interventions={"features": f"{site}:3=0"}))
    with pytest.raises(InputError, match="has features 0..47"):
        run(tiny_model, TraceRequest(token_ids=IDS, dictionaries=(sae,), interventions={"features": f"{site}:48=0"}))
    with pytest.raises(InputError, match="expected SITE:FEATURE=0"):
        TraceRequest(token_ids=IDS, interventions={"features": f"{site}:3/2"}).check()


def test_a_transcoder_edit_changes_the_ffn_update(tiny_model):
    transcoder = dictionary("transcoder", "layers.2.ffn", n=40, k=20, seed=4)
    record = ("layers.2.resid_mid", "layers.2.ffn_out", "layers.1.resid_post")
    base = run(tiny_model, TraceRequest(token_ids=IDS, record=record, dictionaries=(transcoder,)))
    feature = int(base["layers.2.ffn.features.top_ids"][4, 0])
    edited = run(
        tiny_model,
        TraceRequest(
            token_ids=IDS, record=record, dictionaries=(transcoder,), interventions={"features": f"layers.2.ffn:{feature}=0@4"}
        ),
    )
    block = tiny_model.layers[2]
    act = transcoder.encode(block.ffn_norm(base["layers.2.resid_mid"][4], block.dtype))[feature]
    want = (base["layers.2.ffn_out"][4] - act * transcoder.W_dec[feature].detach()).to(block.dtype).float()  # the update's dtype
    assert torch.equal(edited["layers.2.ffn_out"][4], want)
    assert torch.equal(edited["layers.2.ffn_out"][:4], base["layers.2.ffn_out"][:4])
    assert torch.equal(edited["layers.2.resid_mid"], base["layers.2.resid_mid"])


def test_bad_dictionaries_are_refused_in_one_line(capsys, tiny_checkpoint, tmp_path):
    wide = save(dictionary(width=TINY.dim + 8), tmp_path / "wide")
    late = save(dictionary(site=f"layers.{TINY.n_layers}.resid_post"), tmp_path / "late")
    out = tmp_path / "t.safetensors"
    for directory, words in ((wide, f"the model's stream is {TINY.dim}"), (late, f"the model has {TINY.n_layers} blocks")):
        code = main(
            [
                "run",
                "--checkpoint",
                str(tiny_checkpoint),
                "--token-ids",
                "1,2,3",
                "--dictionary",
                str(directory),
                "--out",
                str(out),
            ]
        )
        err = capsys.readouterr().err.strip()
        assert code == 2 and words in err and len(err.splitlines()) == 1, err
    good = save(dictionary(), tmp_path / "good")
    twice = ["--dictionary", str(good), "--dictionary", str(good)]
    code = main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", *twice, "--out", str(out)])
    assert code == 2 and "one per site" in capsys.readouterr().err
    code = main(["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3", "--record", "features", "--out", str(out)])
    assert code == 2 and "--dictionary DIR" in capsys.readouterr().err
    assert not out.exists()
    argv = ["run", "--checkpoint", str(tiny_checkpoint), "--token-ids", "1,2,3,4", "--dictionary", str(good), "--out", str(out)]
    assert main([*argv, "--feature", "layers.1.resid_post:5*0.5@2", "--csv", str(tmp_path / "csv")]) == 0
    capsys.readouterr()
    assert Trace.load(out).extra["dictionaries"]["layers.1.resid_post"]["name"] == "good"
    assert (tmp_path / "csv" / "features.csv").is_file()
