"""Export: every table as CSV and Parquet, the trace file, and all CSVs in one ZIP."""

from __future__ import annotations

import streamlit as st

from app.topics import export
from app.topics.export import OCTETS, ZIP
from app.ui import widgets


def page() -> None:
    view = widgets.page_view(
        "Export",
        "Every table the views read, as CSV (UTF-8, spreadsheet-safe) or Parquet, and the trace itself as a "
        ".safetensors file you can open again here (source: Trace file) or with `python -m tracing export`.",
    )
    if view is None:
        return
    entry = view.entry
    stem = f"trace-{view.n_tokens}tok-{entry.key.fingerprint()}"
    tables = view.tables()
    cols = st.columns(3)
    trace_file, zip_file = f"{stem}.safetensors", f"{stem}-tables.zip"
    widgets.download(cols[0], "Trace file (.safetensors)", entry.trace_bytes, trace_file, OCTETS, "dl_trace", ":material/save:")
    widgets.download(
        cols[1], "All tables (CSV, zip)", lambda: export.zip_bytes(tables), zip_file, ZIP, "dl_zip", ":material/folder_zip:"
    )
    cols[2].caption(f"{len(view.trace.tensors)} tensors, {entry.nbytes / 2**20:.1f} MiB in memory; {len(tables)} tables.")

    for name, frame in tables.items():
        with st.container(border=True):
            head, csv, parquet = st.columns([6, 1, 1], vertical_alignment="center")
            head.markdown(f"**{name}** · {len(frame):,} rows × {frame.shape[1]} columns  \n{export.describe(name)}")
            widgets.csv_button(csv, frame, f"{stem}-{name}.csv", f"dl_csv_{name}")
            widgets.download(
                parquet,
                "Parquet",
                lambda frame=frame: export.parquet_bytes(frame),
                f"{stem}-{name}.parquet",
                "application/vnd.apache.parquet",
                f"dl_parquet_{name}",
            )
            st.code(export.csv_header(frame), language=None)

    st.subheader("Preview", anchor=False)
    name = st.selectbox("Table", list(tables), key="export_preview")
    widgets.table(st, tables[name].head(500), name)


if __name__ == "__main__":
    page()
