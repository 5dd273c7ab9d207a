"""Tables as files: CSV that a spreadsheet opens safely, and Parquet, written together or not at all."""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd

from ..cli.output import Outputs
from ..trace import Trace
from .frames import BUILDERS, tables

_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def csv_safe(frame: pd.DataFrame) -> pd.DataFrame:
    """Text cells a spreadsheet would run as formulas get a leading apostrophe; numbers untouched."""
    out = frame
    for column in frame.columns:
        if frame[column].dtype == object or pd.api.types.is_string_dtype(frame[column]):
            values = frame[column].astype(str)
            risky = values.str.startswith(_FORMULA_START)
            if risky.any():
                if out is frame:
                    out = frame.copy()
                out[column] = values.where(~risky, "'" + values)
    return out


def to_csv_bytes(frame: pd.DataFrame) -> bytes:
    # CRLF rows (RFC 4180): the writer then quotes any cell holding a carriage return or newline
    return csv_safe(frame).to_csv(index=False, lineterminator="\r\n").encode("utf-8")


# the names of every table this project writes: the trace's, those of ``diff`` and of the prompt sets
# (tracing.analyses.diff.diff_tables); a reused output directory loses the files of these names it does not rewrite
DIFF_TABLES = ("blocks", "stream", "experts", "indexer_keys", "attention", "predictions", "logits", "next_token")
SET_TABLES = ("causal", "causal_summary", "causal_parts", "eval", "eval_prompts")  # over a set of prompts (prompt_sets)
# a dictionary's feature pages (tracing.dictionary.pages)
PAGE_TABLES = ("feature_summary", "feature_contexts", "feature_logits", "feature_experts", "expert_features")
TABLE_FILES = frozenset(
    f"{name}.{ext}" for name in (*BUILDERS, *DIFF_TABLES, *SET_TABLES, *PAGE_TABLES) for ext in ("csv", "parquet")
)


def export(trace: Trace, directory: str | os.PathLike, parquet: bool = False) -> list[Path]:
    """Write every table of a trace as CSV (and Parquet) into ``directory``."""
    return write_tables(tables(trace), directory, parquet)


def write_tables(frames: dict[str, pd.DataFrame], directory: str | os.PathLike, parquet: bool = False) -> list[Path]:
    """Write tables as ``name.csv`` (and ``name.parquet``), atomically (tracing.cli.output)."""
    with Outputs() as out:
        return stage_tables(out, frames, directory, parquet)


def stage_tables(
    out: Outputs, frames: dict[str, pd.DataFrame], directory: str | os.PathLike, parquet: bool = False
) -> list[Path]:
    """Stage tables into ``directory`` as part of ``out``, so they land together with its other
    outputs. An existing directory afterwards holds only these tables' files of the names this
    project writes (TABLE_FILES): a previous run's others would read as this run's."""
    staged = out.directory(directory, stale=TABLE_FILES)
    written = []
    for name, frame in frames.items():
        data = to_csv_bytes(frame)
        written.append(staged.write(f"{name}.csv", lambda path, data=data: path.write_bytes(data)))
        if parquet:
            written.append(staged.write(f"{name}.parquet", lambda path, frame=frame: frame.to_parquet(path, index=False)))
    return written
