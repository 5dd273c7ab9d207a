"""Tables as files: CSV (tracing.tables.to_csv_bytes: UTF-8, spreadsheet-safe), Parquet, all CSVs
in one ZIP, what each table holds; and a page's figures and tables in one ZIP."""

from __future__ import annotations

import html
import io
import re
import unicodedata
import zipfile

import pandas as pd
import plotly.graph_objects as go
import plotly.offline

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


def page_zip_bytes(items: list[tuple[str, go.Figure | pd.DataFrame]]) -> bytes:
    """A page's figures and tables: ``figures/NAME.html`` (standalone and interactive, reading
    ``figures/plotly.min.js`` beside it, so it opens offline) with ``figures/NAME.json`` (the figure as
    plotly reads it: ``plotly.io.read_json``), and ``tables/NAME.csv``; names from the titles, made
    unique."""
    buffer, used = io.BytesIO(), set()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        figures = False
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
            figures = True
            archive.writestr(f"figures/{name}.html", item.to_html(include_plotlyjs="directory", full_html=True))
            archive.writestr(f"figures/{name}.json", item.to_json())
        if figures:
            archive.writestr("figures/plotly.min.js", plotly.offline.get_plotlyjs())
    return buffer.getvalue()
