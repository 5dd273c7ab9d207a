"""Tables as files: CSV (tracing.tables.to_csv_bytes: UTF-8, spreadsheet-safe), Parquet, all CSVs
in one ZIP, what each table holds; and a page's figures (HTML, JSON, and SVG/PNG where kaleido and a
Chrome are at hand) and tables in one ZIP."""

from __future__ import annotations

import asyncio
import html
import importlib.metadata
import io
import os
import re
import threading
import time
import unicodedata
import zipfile

import pandas as pd
import plotly.graph_objects as go
import plotly.offline

from app.core.keys import Key
from tracing.tables import BUILDERS, to_csv_bytes

OCTETS, ZIP = "application/octet-stream", "application/zip"  # the MIME types of a trace file and a ZIP of tables
DESCRIPTIONS = {
    "tokens": "Per position: the token id and its text.",
    "next_token": "The model's top next tokens after the last position, with probability and logit.",
}


def parquet_bytes(frame: pd.DataFrame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def zip_bytes(tables: dict[str, pd.DataFrame]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, frame in tables.items():
            archive.writestr(f"{name}.csv", to_csv_bytes(frame))
    return buffer.getvalue()


def describe(name: str) -> str:
    """What a table holds: its builder's first docstring paragraph (tracing.tables)."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    doc = (BUILDERS[name].__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines())


def csv_header(frame: pd.DataFrame) -> str:
    """The CSV's first line, exactly as the download writes it."""
    return to_csv_bytes(frame.head(0)).decode("utf-8").rstrip("\r\n")


def slug(title: str, limit: int = 80) -> str:
    """A file name from a title: ASCII letters, digits, dot, dash and underscore only (no path
    separators, no markup), at most ``limit`` characters; ``figure`` when nothing is left."""
    text = unicodedata.normalize("NFKD", html.unescape(re.sub(r"<[^>]*>", " ", title)))
    text = text.encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-._")
    return text[:limit].rstrip("-._") or "figure"


IMAGE_LIMIT = 40  # figures drawn as SVG/PNG per zip: each costs a second or so in the browser
IMAGE_SECONDS = 90.0  # the whole SVG/PNG export, browser start included; figures left then are named
RENDER_SECONDS = 30.0  # one image; kaleido gives up on it then
PNG_SCALE = 2
FORMATS = [  # kaleido's options for each image, and how its file begins
    ("svg", {"format": "svg"}, b"<svg"),
    ("png", {"format": "png", "scale": PNG_SCALE}, b"\x89PNG\r\n\x1a\n"),
]
HOW_TO_GET_IMAGES = "pip install 'kaleido>=1' and install Chrome or Chromium (or set BROWSER_PATH to one)"


def find_browser() -> str | None:
    """The Chrome or Chromium kaleido would drive (BROWSER_PATH when set, else the PATH, the usual
    install places and kaleido_get_chrome's download), or None when there is none that runs: kaleido
    itself would take a BROWSER_PATH that names nothing and fail only on the first figure."""
    try:
        from choreographer.browsers.chromium import Chromium
    except ImportError:
        return None
    path = Chromium.find_browser(skip_local=False)
    return path if path and os.path.isfile(path) and os.access(path, os.X_OK) else None


def images_unavailable() -> str | None:
    """Why this machine cannot write SVG/PNG, with how to get them; None when it can."""
    try:
        version = importlib.metadata.version("kaleido")
    except importlib.metadata.PackageNotFoundError:
        return f"no SVG/PNG: kaleido is not installed; to get them, {HOW_TO_GET_IMAGES}"
    if int(re.match(r"\d*", version).group() or 0) < 1:
        return f"no SVG/PNG: kaleido {version} is too old for plotly's image export; to get them, {HOW_TO_GET_IMAGES}"
    if find_browser() is None:
        where = (
            f"BROWSER_PATH={os.environ['BROWSER_PATH']!r} is no browser"
            if "BROWSER_PATH" in os.environ
            else "kaleido found no Chrome or Chromium"
        )
        return f"no SVG/PNG: {where}; to get them, {HOW_TO_GET_IMAGES}"
    return None


def figure_images(figures: dict[str, go.Figure], browser: str) -> tuple[dict[str, bytes], list[str]]:
    """Each figure as ``NAME.svg`` and ``NAME.png`` (scale 2), drawn by one browser for them all
    (kaleido starts one per call otherwise, seconds each), and one line per image left out saying
    why. An image that fails costs only itself; the first IMAGE_LIMIT figures only, within
    IMAGE_SECONDS."""
    names = list(figures)
    images: dict[str, bytes] = {}
    failed = [f"{name}: no SVG/PNG, more than {IMAGE_LIMIT} figures" for name in names[IMAGE_LIMIT:]]
    done: set[str] = set()
    left = [f"the {IMAGE_SECONDS:g} s export budget ran out"]  # why the figures not reached have no images

    async def draw() -> None:
        from kaleido import Kaleido

        deadline = time.monotonic() + IMAGE_SECONDS
        async with Kaleido(n=1, timeout=RENDER_SECONDS, mathjax=False, path=browser) as kaleido:
            for name in names[:IMAGE_LIMIT]:
                if time.monotonic() > deadline:
                    break
                for kind, opts, signature in FORMATS:
                    try:
                        data = await kaleido.calc_fig(figures[name], opts=opts)
                    except Exception as error:  # kaleido's, the browser's or a timeout: this image only
                        failed.append(f"{name}: no {kind.upper()}, {reason(error)}")
                        continue
                    if data.lstrip()[: len(signature)] != signature:  # a canvas too large comes back as a few bytes
                        failed.append(f"{name}: no {kind.upper()}, the browser drew no image ({len(data)} bytes)")
                        continue
                    images[f"{name}.{kind}"] = data
                done.add(name)

    def run() -> None:  # a thread of its own: the caller may already be inside an event loop
        try:
            asyncio.run(asyncio.wait_for(draw(), IMAGE_SECONDS + RENDER_SECONDS))
        except Exception as error:  # the browser did not start or stopped answering
            left[0] = f"the export stopped, {reason(error)}"

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(IMAGE_SECONDS + 2 * RENDER_SECONDS)  # past it the zip goes without the rest
    finished = set(done)
    failed += [f"{name}: no SVG/PNG, {left[0]}" for name in names[:IMAGE_LIMIT] if name not in finished]
    return {name: data for name, data in list(images.items()) if name.rsplit(".", 1)[0] in finished}, failed


def reason(error: BaseException) -> str:
    """An error in one line: its type, and its message when it has one (a timeout has none)."""
    message = " ".join(str(error).split())
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def page_zip_bytes(items: list[tuple[str, go.Figure | pd.DataFrame]], images: bool = True) -> bytes:
    """A page's figures and tables: ``figures/NAME.html`` (standalone and interactive, reading
    ``figures/plotly.min.js`` beside it, so it opens offline) with ``figures/NAME.json`` (the figure as
    plotly reads it: ``plotly.io.read_json``) and, when ``images`` and kaleido can (figure_images),
    ``figures/NAME.svg`` and ``figures/NAME.png``; ``tables/NAME.csv``; names from the titles, made
    unique; ``README.txt`` says what is there and why an image is missing."""
    buffer, used, figures = io.BytesIO(), set(), {}
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for title, item in items:
            folder = "tables" if isinstance(item, pd.DataFrame) else "figures"
            name, n = slug(title), 1
            while f"{folder}/{name}" in used:
                n += 1
                name = f"{slug(title)}-{n}"
            used.add(f"{folder}/{name}")
            if folder == "tables":
                archive.writestr(f"tables/{name}.csv", to_csv_bytes(item))
                continue
            figures[name] = item
            archive.writestr(f"figures/{name}.html", item.to_html(include_plotlyjs="directory", full_html=True))
            archive.writestr(f"figures/{name}.json", item.to_json())
        notes = []
        if figures:
            archive.writestr("figures/plotly.min.js", plotly.offline.get_plotlyjs())
            why = images_unavailable() if images else "no SVG/PNG: not asked for"
            if why is None:
                drawn, notes = figure_images(figures, find_browser())
                for name, data in drawn.items():
                    archive.writestr(f"figures/{name}", data)
            else:
                notes = [why]
        archive.writestr("README.txt", readme(notes))
    return buffer.getvalue()


def readme(notes: list[str]) -> str:
    lines = [
        "figures/NAME.html: the figure, interactive; open it in a browser (it reads plotly.min.js beside it).",
        "figures/NAME.json: the figure as plotly reads it (plotly.io.read_json).",
        f"figures/NAME.svg, figures/NAME.png: the figure as an image (PNG at scale {PNG_SCALE}), drawn by kaleido.",
        "tables/NAME.csv: the table (UTF-8).",
    ]
    return "\n".join([*lines, *(["", *notes] if notes else [])]) + "\n"


# the Export page's session keys (app.core.session assembles every page's into its schema)
KEYS: tuple[Key, ...] = (
    Key("export_preview", "Export: the table previewed"),
    Key("dl_trace", "Export: the trace file's download"),
    Key("dl_zip", "Export: every table's download"),
    Key("dl_csv_", "Export: a table's CSV download (the table)", family=True),
    Key("dl_parquet_", "Export: a table's Parquet download (the table)", family=True),
)
