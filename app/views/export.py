"""Export: every table as CSV and Parquet, the trace file, and all CSVs in one ZIP."""

from __future__ import annotations

import hashlib
import io
import zipfile

import streamlit as st

from app import state, widgets
from tracing.tables import BUILDERS, to_csv_bytes


def parquet_bytes(frame) -> bytes:
    buffer = io.BytesIO()
    frame.to_parquet(buffer, index=False)
    return buffer.getvalue()


def zip_bytes(tables: dict) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, frame in tables.items():
            archive.writestr(f"{name}.csv", to_csv_bytes(frame))
    return buffer.getvalue()


DESCRIPTIONS = {
    "tokens": "Per position: the token id and its text.",
    "next_token": "The model's top next tokens after the last position, with probability and logit.",
}


def describe(name: str) -> str:
    """What a table holds: its builder's first docstring paragraph (tracing.tables)."""
    if name in DESCRIPTIONS:
        return DESCRIPTIONS[name]
    doc = (BUILDERS[name].__doc__ or "").strip().split("\n\n")[0]
    return " ".join(line.strip() for line in doc.splitlines())


def page() -> None:
    view = state.current()
    widgets.page_header(
        "Export",
        "Every table the views read, as CSV (UTF-8, spreadsheet-safe) or Parquet, and the trace itself as a "
        ".safetensors file you can open again here (source: Trace file) or with `python -m tracing export`.",
        view,
    )
    if view is None:
        widgets.no_trace()
        return
    entry = view.entry
    stem = _stem(view)
    tables = view.tables()
    cols = st.columns(3)
    cols[0].download_button(
        "Trace file (.safetensors)",
        data=entry.trace_bytes,
        file_name=f"{stem}.safetensors",
        mime="application/octet-stream",
        icon=":material/save:",
        key="dl_trace",
        on_click="ignore",
        width="stretch",
    )
    cols[1].download_button(
        "All tables (CSV, zip)",
        data=lambda: zip_bytes(tables),
        file_name=f"{stem}-tables.zip",
        mime="application/zip",
        icon=":material/folder_zip:",
        key="dl_zip",
        on_click="ignore",
        width="stretch",
    )
    cols[2].caption(f"{len(view.trace.tensors)} tensors, {entry.nbytes / 2**20:.1f} MiB in memory; {len(tables)} tables.")

    for name, frame in tables.items():
        with st.container(border=True):
            head, csv, parquet = st.columns([6, 1, 1], vertical_alignment="center")
            head.markdown(f"**{name}** · {len(frame):,} rows × {frame.shape[1]} columns  \n{describe(name)}")
            widgets.csv_button(csv, frame, f"{stem}-{name}.csv", f"dl_csv_{name}")
            parquet.download_button(
                "Parquet",
                data=lambda frame=frame: parquet_bytes(frame),
                file_name=f"{stem}-{name}.parquet",
                mime="application/vnd.apache.parquet",
                key=f"dl_parquet_{name}",
                on_click="ignore",
                width="stretch",
            )
            st.code(_header(frame), language=None)

    st.subheader("Preview", anchor=False)
    name = st.selectbox("Table", list(tables), key="export_preview")
    st.dataframe(tables[name].head(500), hide_index=True, width="stretch")


def _header(frame) -> str:
    """The CSV's first line, exactly as the download writes it."""
    return to_csv_bytes(frame.head(0)).decode("utf-8").rstrip("\r\n")


def _stem(view) -> str:
    digest = hashlib.sha256(repr(view.entry.key).encode()).hexdigest()[:8]
    return f"trace-{view.n_tokens}tok-{digest}"


if __name__ == "__main__":
    page()
