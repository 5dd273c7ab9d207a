"""Tables as files: CSV (tracing.tables.to_csv_bytes: UTF-8, spreadsheet-safe), Parquet, all CSVs
in one ZIP, and what each table holds."""

from __future__ import annotations

import io
import zipfile

import pandas as pd

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
