"""The Atlas page, run headless with AppTest: the bundled demo atlas opens at once and every section
draws from its tables; an atlas directory or a zip of one opens too; a bad path, a damaged table or a
hostile zip gives one st.error and the page stays usable."""

from __future__ import annotations

import io
import shutil
import zipfile

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

from app.core import settings
from app.topics import atlas as topic
from tests.app.test_app import APP, TIMEOUT, messages, plotly_charts
from tracing.atlas import read_atlas

PAGE = "views/atlas.py"
pytestmark = pytest.mark.skipif(not (topic.BUNDLED / "summary.json").is_file(), reason="assets/demo_atlas is not built")


@pytest.fixture()
def app(app_checkpoint, monkeypatch) -> AppTest:
    monkeypatch.setenv(settings.ENV_CHECKPOINT, app_checkpoint)
    return checked(AppTest.from_file(APP, default_timeout=TIMEOUT).run().switch_page(PAGE).run())


def checked(at: AppTest) -> AppTest:
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, messages(at.error)
    return at


def chart_titles(at: AppTest) -> list[str]:
    import json

    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in plotly_charts(at)]


def show(at: AppTest, section: str) -> AppTest:
    return checked(at.button_group(key="atlas_section").set_value(section).run())


def test_the_bundled_atlas_opens_with_the_expert_load(app):
    bundled = read_atlas(topic.BUNDLED)
    assert f"{bundled.summary['tokens']:,} tokens" in messages(app.markdown)
    titles = chart_titles(app)
    assert any(t.startswith("Expert load") for t in titles) and any(t.startswith("Imbalance") for t in titles)
    app.toggle(key="atlas_sorted").set_value(True).run()
    assert any("busiest first" in str(c.proto.spec) for c in plotly_charts(checked(app)))


def test_every_section_draws_from_the_tables(app):
    bundled = read_atlas(topic.BUNDLED)
    moe = topic.blocks(bundled)
    show(app, "Co-activation")
    assert any("fire together" in t for t in chart_titles(app))
    app.toggle(key="atlas_lift").set_value(False).run()
    assert any("chose both" in t for t in chart_titles(checked(app)))

    show(app, "One expert")
    busiest = bundled.tables["expert_load"].query("block == @moe[-1]").sort_values("count").iloc[-1]
    app.selectbox(key="atlas_block").set_value(moe[-1])
    app.number_input(key="atlas_expert").set_value(int(busiest["expert"])).run()
    checked(app)
    assert f"chosen for {int(busiest['count']):,} tokens" in messages(app.markdown)
    specific, partners = app.dataframe[0].value, app.dataframe[1].value
    want = bundled.tables["expert_tokens"].query("block == @moe[-1] and expert == @busiest.expert")
    assert list(specific["token_id"]) == list(want.sort_values("specificity", ascending=False)["token_id"])
    assert len(partners) > 0 and (partners["tokens_together"].diff().dropna() <= 0).all()

    show(app, "Routing bias")
    assert any("correction bias" in t for t in chart_titles(app))

    show(app, "Indexer")
    titles = chart_titles(app)
    assert any("How far back" in t for t in titles)
    positions, tokens = app.dataframe[0].value, app.dataframe[1].value
    assert (positions["lift"].diff().dropna() <= 0).all() and (positions["selected"] <= positions["visible"]).all()
    assert len(tokens) > 0


def test_the_per_block_overlaps_and_near_ties_are_drawn(app, tmp_path):
    """An atlas with the block_measures table: the Routing bias section draws the near-tie shares and
    the Indexer section the overlap with the block before, each beside its table."""
    from tracing.cli.commands import main
    from tracing.cli.loading import DEMO

    out = tmp_path / "atlas"
    args = ["atlas", "--checkpoint", "demo", "--text-file", str(DEMO / "heldout_sample.txt"), "--seq-len", "128"]
    assert main([*args, "--max-tokens", "300", "--out", str(out)]) == 0
    measures = read_atlas(out).tables["block_measures"]
    app.sidebar.radio(key="atlas_source").set_value("dir").run()
    app.sidebar.text_input(key="atlas_dir").set_value(str(out)).run()
    show(checked(app), "Routing bias")
    near = next(c for c in plotly_charts(app) if "Near-ties" in str(c.proto.spec))
    assert {t["name"] for t in __import__("json").loads(near.proto.spec)["data"]} == {"near-tie experts", "near-tie groups"}
    show(app, "Indexer")
    assert any("overlap the block before" in t for t in chart_titles(app))
    assert app.dataframe[-1].value["overlap_prev"].tolist() == pytest.approx(measures["overlap_prev"].tolist(), nan_ok=True)


def test_a_directory_and_a_zip_of_it_open(app, tmp_path):
    folder = tmp_path / "atlas"
    shutil.copytree(topic.BUNDLED, folder)
    app.sidebar.radio(key="atlas_source").set_value("dir").run()
    app.sidebar.text_input(key="atlas_dir").set_value(str(folder)).run()
    assert any(t.startswith("Expert load") for t in chart_titles(checked(app)))

    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        for file in folder.iterdir():
            z.write(file, f"atlas/{file.name}")  # zipped as its folder
    app.sidebar.radio(key="atlas_source").set_value("upload").run()
    app.sidebar.file_uploader(key="atlas_upload").set_value(("atlas.zip", archive.getvalue(), "application/zip")).run()
    assert any(t.startswith("Expert load") for t in chart_titles(checked(app)))


def test_bad_atlases_give_one_error_and_the_page_stays_usable(app, tmp_path):
    app.sidebar.radio(key="atlas_source").set_value("dir").run()
    app.sidebar.text_input(key="atlas_dir").set_value(str(tmp_path / "nowhere")).run()
    assert not app.exception and "not a directory" in messages(app.error)
    app.sidebar.text_input(key="atlas_dir").set_value(f"{tmp_path}/a\0b").run()
    assert not app.exception and "Atlas not opened" in messages(app.error), messages(app.error)

    damaged = tmp_path / "damaged"
    shutil.copytree(topic.BUNDLED, damaged)
    pd.DataFrame({"block": [0]}).to_parquet(damaged / "expert_load.parquet")
    app.sidebar.text_input(key="atlas_dir").set_value(str(damaged)).run()
    assert not app.exception and "no column 'expert'" in messages(app.error)

    app.sidebar.radio(key="atlas_source").set_value("upload").run()
    upload = app.sidebar.file_uploader(key="atlas_upload")
    upload.set_value(("notes.zip", b"not a zip at all", "application/zip")).run()
    assert not app.exception and "not a zip archive" in messages(app.error)

    hostile = io.BytesIO()
    with zipfile.ZipFile(hostile, "w") as z:
        z.writestr("../../outside.txt", "x")
        z.writestr("../summary.json", "{}")  # read under its base name, inside the page's own folder
    app.sidebar.file_uploader(key="atlas_upload").set_value(("hostile.zip", hostile.getvalue(), "application/zip")).run()
    assert not app.exception and "not the summary of an atlas" in messages(app.error)
    assert not (tmp_path.parent / "outside.txt").exists()

    app.sidebar.radio(key="atlas_source").set_value("bundled").run()
    assert any(t.startswith("Expert load") for t in chart_titles(checked(app)))
