"""The Features page, run headless with AppTest: pages a corpus run wrote open from their directory,
each view is a link (the same view reopens from the URL alone), every table has its CSV, and a
directory that holds no pages is one st.error."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

from app.core import settings
from app.topics import features as topic
from model import TINY
from tests.app.apptest import APP, TIMEOUT, messages, raised_nothing
from tests.tracing.dictionary.test_features import dictionary
from tracing.cli.loading import Loaded
from tracing.dictionary.pages import PageSettings, feature_pages
from tracing.tables import write_tables

PAGE = "views/features.py"


def test_the_features_page_opens_pages_and_a_link_reopens_the_view(tiny_model, app_checkpoint, monkeypatch, tmp_path):
    ids = torch.randint(0, TINY.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).tolist()
    loaded = Loaded(tiny_model, None, None, "tiny", torch.device("cpu"))
    d = dictionary(site="layers.1.resid_post", n=16, k=3)
    tables = feature_pages(loaded, {"resid": d}, [ids], PageSettings(contexts=3, window=2, logit_tokens=3))
    write_tables(tables, tmp_path / "pages")
    summary = tables["feature_summary"]
    feature = int(summary.sort_values("max_activation").iloc[-1]["feature"])
    token = tables["feature_contexts"].query("feature == @feature").iloc[0]["token"]

    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    # no checkpoint typed: no model loads, no prompt is traced (the page needs none); the pages from a directory
    at.query_params.update({"source": "dir", "feat_source": "dir"})
    raised_nothing(at.run().switch_page(PAGE).run())
    at.text_input(key="feat_dir").set_value(str(tmp_path / "pages")).run()
    assert not at.error, messages(at.error)
    assert len(at.dataframe[0].value) == d.n_features  # every feature, strongest first
    at.text_input(key="feat_search").set_value(token).run()  # a token of its strongest context finds it
    assert feature in list(at.dataframe[0].value["feature"])
    raised_nothing(at.button_group(key="feat_section").set_value("One feature").run())
    raised_nothing(at.number_input(key="feat_id").set_value(feature).run())
    assert f"Feature {feature}" in messages(at.markdown)
    contexts = at.dataframe[0].value
    assert list(contexts["activation"]) == sorted(contexts["activation"], reverse=True) and len(contexts) == 3
    assert len(at.get("download_button")) >= len(at.dataframe)  # every table downloadable (and the page's zip)
    link = dict(at.query_params)
    assert link["feat_section"] == "One feature" and link["feat_id"] == str(feature)

    again = AppTest.from_file(APP, default_timeout=TIMEOUT)  # a new visit with the link alone
    again.query_params.update(link)
    raised_nothing(again.run().switch_page(PAGE).run())
    assert not again.error, messages(again.error)
    assert again.number_input(key="feat_id").value == feature
    assert again.dataframe[0].value.equals(contexts)

    again.text_input(key="feat_dir").set_value(str(tmp_path)).run()  # no pages there
    assert "Pages not opened" in messages(again.error) and "feature_summary.csv" in messages(again.error)
    if topic.bundled_pages():  # the demo's dictionaries' pages open without a directory
        raised_nothing(again.radio(key="feat_source").set_value("bundled").run())
        assert not again.error, messages(again.error)
        assert set(again.selectbox(key="feat_dictionary").options) == set(topic.bundled_dictionaries())
        # the feature's 5 contexts, 5 promoted and 5 suppressed tokens, and its experts
        assert [len(t.value) for t in again.dataframe[:3]] == [5, 5, 5] and len(again.dataframe) == 4


@pytest.mark.slow
@pytest.mark.parametrize("bundled", [True, False], ids=["bundled", "typed"])
def test_this_prompt_reads_the_sessions_prompt_with_a_dictionary_and_edits_a_feature(
    app_checkpoint, monkeypatch, tmp_path, bundled
):
    """The demo's bundled autoencoder of layers.1.resid_post (1024 features), or one typed."""
    from app.topics import features as topic
    from model.checkpoint import SafetensorsSource
    from tracing.cli.loading import resolve_checkpoint
    from tracing.dictionary import save

    if bundled and "layers_1_resid_post" not in topic.bundled_dictionaries():
        pytest.skip("assets/dictionaries is not built")
    dim = SafetensorsSource(resolve_checkpoint(app_checkpoint)).args.dim
    save(dictionary(site="layers.1.resid_post", n=32, k=4, width=dim), tmp_path / "resid")
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    at = AppTest.from_file(APP, default_timeout=TIMEOUT)
    at.query_params.update({"prompt": "It is a truth", "feat_section": "This prompt"})
    raised_nothing(at.run().switch_page(PAGE).run())
    if bundled:
        at.selectbox(key="feat_prompt_dictionary").set_value("layers_1_resid_post").run()
    else:
        at.selectbox(key="feat_prompt_dictionary").set_value("a directory").run()
        at.text_input(key="feat_dict_dir").set_value(str(tmp_path / "resid")).run()
    at.number_input(key="feat_id").set_value(3)
    at.selectbox(key="feat_edit").set_value("add").run()
    at.number_input(key="feat_amount").set_value(50.0).run()
    raised_nothing(at.button(key="feat_run").click().run())
    assert not at.error, messages(at.error)
    features, tokens = at.dataframe[0].value, at.dataframe[1].value
    assert set(features["feature"]) <= set(range(1024 if bundled else 32)) and (features["activation"] > 0).all()
    assert not tokens["probability"].equals(tokens["edited_probability"])  # the edit moved the prediction
    assert "layers.1.resid_post:3+50" in messages(at.markdown)


def test_pages_that_are_not_pages_are_one_line_and_search_takes_any_text(tmp_path):
    from app.topics import features as topic

    (tmp_path / "feature_summary.csv").write_text("dictionary,feature\nx,1\n")
    for name in ("feature_contexts", "feature_logits"):
        (tmp_path / f"{name}.csv").write_text("a\n1\n")
    with pytest.raises(topic.PagesError, match="no column 'site': not a feature page's table"):
        topic.read_pages(tmp_path, 1 << 20)
    with pytest.raises(topic.PagesError, match="its tables are over the"):
        topic.read_pages(tmp_path, 10)
    (tmp_path / "feature_logits.csv").unlink()
    with pytest.raises(topic.PagesError, match="no feature_logits.csv"):
        topic.read_pages(tmp_path, 1 << 20)
    contexts = pd.DataFrame({"dictionary": "d", "feature": [0, 1], "rank": 0, "activation": [2.0, 1.0]})
    contexts["token"], contexts["context"] = ["'=SUM(A1)", "(["], ["x", "y"]
    summary = pd.DataFrame({"dictionary": "d", "site": "s", "feature": [0, 1], "active_positions": 1, "density": 0.1})
    summary["mean_activation"], summary["max_activation"] = 1.0, [2.0, 1.0]
    logits = pd.DataFrame({c: [] for c in topic.NEEDED["feature_logits"]})
    pages = topic.Pages({"feature_summary": summary, "feature_contexts": contexts, "feature_logits": logits})
    assert topic.search(pages, "d", "([")["feature"].tolist() == [1]  # text, not a pattern
    assert topic.search(pages, "d", "1")["feature"].tolist() == [1] and len(topic.search(pages, "d", " ")) == 2
    assert topic._unguarded(contexts["token"]).tolist() == ["=SUM(A1)", "(["]  # the CSV's formula guard undone


def test_a_servers_dictionaries_are_named_from_its_info_and_a_malformed_list_is_none():
    from types import SimpleNamespace

    from app.topics import features as topic

    info = {"resid": {"site": "layers.1.resid_post", "kind": "sae", "n_features": 32, "k": 4}, "bad": {"site": 3}}
    assert topic.served_dictionaries(SimpleNamespace(facts={"dictionaries": info})) == {"resid": info["resid"]}
    assert topic.served_dictionaries(SimpleNamespace(facts={"dictionaries": ["resid"]})) == {}
    assert topic.served_dictionaries(SimpleNamespace()) is None  # a model loaded here reads directories
    assert topic.edit_spec("layers.1.resid_post", 3, "add", -2.5, " 4:9 ") == "layers.1.resid_post:3-2.5@4:9"
    assert topic.edit_spec("layers.2.ffn", 7, "scale", 0.5, "") == "layers.2.ffn:7*0.5"
    from tracing.analyses.intervention_specs import from_spec

    (edit,) = from_spec({"features": topic.edit_spec("layers.1.resid_post", 3, "add", -2.5, "4:9")})
    assert (edit.site, edit.feature, edit.scale, edit.add, edit.positions) == ("layers.1.resid_post", 3, 1.0, -2.5, (4, 9))
