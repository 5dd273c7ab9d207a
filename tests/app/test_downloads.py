"""Every page offers its figures and tables in one zip: run headless on the bundled demo, each page
draws its button at the end, and the zip holds one HTML file (with its JSON) per figure drawn and one
CSV per table drawn, named from their titles; with kaleido and a Chrome also an SVG and a PNG per
figure, without them a README.txt that says why there are none."""

from __future__ import annotations

import io
import time
import xml.etree.ElementTree as ElementTree
import zipfile

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from app.core import pages
from app.topics import export
from app.topics.export import page_zip_bytes, slug
from app.ui import widgets
from tests.app.apptest import raised_nothing, start
from tests.chromium import CHROMIUM

SHOWN = [p for p in pages.PAGES if p.name not in ("interventions", "patching")]  # those draw after a button press


@pytest.fixture(scope="module")
def app(app_checkpoint):
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield start(monkeypatch, app_checkpoint)


def page_zip(at, images: bool = False) -> zipfile.ZipFile:
    items = at.session_state[widgets.DRAWN]["items"]
    return zipfile.ZipFile(io.BytesIO(page_zip_bytes([(title, item) for _, title, item in items.values()], images)))


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
        assert ("figures/plotly.min.js" in names) == bool(charts) and "README.txt" in names
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
    with zipfile.ZipFile(io.BytesIO(page_zip_bytes([("t", go.Figure()), ("t", frame), ("t", frame)], False))) as archive:
        assert sorted(archive.namelist()) == [
            "README.txt",
            "figures/plotly.min.js",
            "figures/t.html",
            "figures/t.json",
            "tables/t-2.csv",
            "tables/t.csv",
        ]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} for kaleido to draw SVG/PNG in")
@pytest.mark.skipif(export.images_unavailable() is not None, reason=str(export.images_unavailable()))
def test_with_a_browser_each_figure_comes_as_svg_and_png_too(app):
    at = raised_nothing(app.switch_page("views/residual.py").run())
    start = time.perf_counter()
    with page_zip(at, images=True) as archive:
        seconds = time.perf_counter() - start
        names = archive.namelist()
        figures = [n.removesuffix(".html") for n in names if n.endswith(".html")]
        assert figures and sorted(n for n in names if n.endswith((".svg", ".png"))) == sorted(
            f"{f}.{kind}" for f in figures for kind in ("png", "svg")
        )
        for name in figures:
            root = ElementTree.fromstring(archive.read(f"{name}.svg"))
            assert root.tag == "{http://www.w3.org/2000/svg}svg"
            width = float(root.get("width"))
            assert png_size(archive.read(f"{name}.png"))[0] == export.PNG_SCALE * width  # scale 2
        assert "no SVG/PNG" not in archive.read("README.txt").decode()
    assert seconds < 60, f"{len(figures)} figures took {seconds:.0f} s: one browser for them all, not one each"


def test_without_a_browser_the_zip_has_html_and_json_and_says_why(app, monkeypatch):
    monkeypatch.setenv("BROWSER_PATH", "/nonexistent/chrome")
    at = raised_nothing(app.switch_page("views/residual.py").run())
    (button,) = [b for b in at.get("download_button") if "page_zip" in b.proto.id]
    assert "no SVG/PNG: BROWSER_PATH='/nonexistent/chrome' is no browser" in button.proto.help
    figure = go.Figure(go.Bar(y=[1, 2]), layout_title_text="Bars")
    with zipfile.ZipFile(io.BytesIO(page_zip_bytes([("Bars", figure)]))) as archive:
        assert sorted(archive.namelist()) == ["README.txt", "figures/Bars.html", "figures/Bars.json", "figures/plotly.min.js"]
        readme = archive.read("README.txt").decode()
    assert "no SVG/PNG: BROWSER_PATH='/nonexistent/chrome' is no browser" in readme and "pip install 'kaleido>=1'" in readme


@pytest.mark.skipif(not CHROMIUM.exists(), reason=f"no browser at {CHROMIUM} for kaleido to draw SVG/PNG in")
@pytest.mark.skipif(export.images_unavailable() is not None, reason=str(export.images_unavailable()))
def test_a_figure_that_fails_to_draw_is_named_and_the_others_kept(monkeypatch):
    monkeypatch.setattr(export, "IMAGE_LIMIT", 2)
    good = go.Figure(go.Scatter(y=[1, 3, 2]))
    bad = go.Figure(go.Scatter(y=[1, 2]), layout_width=10**7)  # a canvas the browser refuses to make
    items = [("good", good), ("bad", bad), ("over the limit", good)]
    with zipfile.ZipFile(io.BytesIO(page_zip_bytes(items))) as archive:
        names = set(archive.namelist())
        readme = archive.read("README.txt").decode()
    assert {"figures/good.svg", "figures/good.png", "figures/bad.svg"} <= names
    assert not names & {"figures/bad.png", "figures/over-the-limit.svg", "figures/over-the-limit.png"}
    assert "bad: no PNG, the browser drew no image" in readme and "over-the-limit: no SVG/PNG, more than 2" in readme
