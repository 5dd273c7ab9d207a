"""Tidy tables of a Trace (frames: one builder per table, the one place tables are built) and the
files they are written to (files: CSV and Parquet)."""

from .files import TABLE_FILES, csv_safe, export, stage_tables, to_csv_bytes, write_tables
from .frames import BUILDERS, tables

__all__ = ["BUILDERS", "TABLE_FILES", "csv_safe", "export", "stage_tables", "tables", "to_csv_bytes", "write_tables"]
