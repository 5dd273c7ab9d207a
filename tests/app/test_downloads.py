"""Every page offers its figures and tables in one zip: run headless on the bundled demo, each page
draws its button at the end, and the zip holds one HTML file (with its JSON) per figure drawn and one
CSV per table drawn, named from their titles."""

from __future__ import annotations

import io
import zipfile

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from app import pages, widgets
from app.topics.export import page_zip_bytes, slug
from tests.app.apptest import raised_nothing, start

SHOWN = [p for p in pages.PAGES if p.name not in ("interventions", "patching")]  # those draw after a button press


@pytest.fixture(scope="module")
def app(app_checkpoint):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield start(monkeypatch, app_checkpoint)


def page_zip(at) -> zipfile.ZipFile:
    items = at.session_state[widgets.DRAWN]["items"]
    return zipfile.ZipFile(io.BytesIO(page_zip_bytes([(title, item) for _, title, item in items.values()])))


@pytest.mark.parametrize("page", SHOWN, ids=[p.name for p in SHOWN])
def test_each_page_offers_its_figures_and_tables_in_one_zip(app, page):
    at = raised_nothing(app.switch_page(page.path).run())
    buttons = [b for b in at.get("download_button") if b.proto.id.endswith("page_zip") or "page_zip" in b.proto.id]
    charts, frames = at.get("plotly_chart"), at.dataframe
    assert charts or frames, f"the {page.title} page drew nothing"
    assert len(buttons) == 1 and buttons[0].proto.label == "All figures and tables (zip)"
    with page_zip(at) as archive:
        names = archive.namelist()
        html = [n for n in names if n.startswith("figures/") and n.endswith(".html")]
        assert len(html) == len(charts) and len([n for n in names if n.endswith(".json")]) == len(charts)
        assert len([n for n in names if n.startswith("tables/")]) == len(frames)
        assert ("figures/plotly.min.js" in names) == bool(charts)
        for name in html:  # a figure a browser opens offline, and the JSON plotly reads back
            assert 'src="plotly.min.js"' in archive.read(name).decode()
            figure = pio.from_json(archive.read(name.replace(".html", ".json")).decode())
            assert figure.data
        for name in (n for n in names if n.startswith("tables/")):
            assert len(pd.read_csv(io.BytesIO(archive.read(name))).columns) > 0


def test_a_tab_opened_replaces_the_figures_of_the_tab_shown_before(app):
    at = raised_nothing(app.switch_page("views/residual.py").run())
    before = {title for _, title, _ in at.session_state[widgets.DRAWN]["items"].values()}
    at.session_state["residual_tab"] = "Logit lens"
    at = raised_nothing(at.run())
    after = {title for _, title, _ in at.session_state[widgets.DRAWN]["items"].values()}
    assert any(t.startswith("Residual stream norm") for t in before) and not any(
        t.startswith("Residual stream norm") for t in after
    )
    assert any(t.startswith("Logit lens") for t in after) and len(at.get("plotly_chart")) == len(after)


def test_file_names_are_ascii_without_separators():
    assert slug("Block 1: router scores s + b over tokens × experts") == "Block-1-router-scores-s-b-over-tokens-experts"
    assert slug("../../etc/passwd") == "etc-passwd" and slug("a/b\\c") == "a-b-c"
    assert slug("<b>é</b>") == "e" and slug("×÷") == "figure"
    frame = pd.DataFrame({"b": [2]})
    with zipfile.ZipFile(io.BytesIO(page_zip_bytes([("t", go.Figure()), ("t", frame), ("t", frame)]))) as archive:
        assert sorted(archive.namelist()) == [
            "figures/plotly.min.js",
            "figures/t.html",
            "figures/t.json",
            "tables/t-2.csv",
            "tables/t.csv",
        ]
