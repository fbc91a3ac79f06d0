"""Convert a run's CSV data files to Parquet (``trainprobe convert RUN --to parquet``).

Each CSV file ``<name>.csv`` of either tool's layout (V1 or V2, trainprobe's or the reference's)
gets a ``<name>.parquet`` beside it with the same columns in the same order (keys and
``micro_step`` BIGINT, names and ``shape``/``dtype`` VARCHAR, ops DOUBLE; an empty cell NULL) and
the same rows, a torn last record left out. The file is written under a temporary name and
renamed when complete, so a reader never sees half a file. Its footer carries the summary the
sink's files carry (:mod:`~trainprobe.engine.sinks.parquet_summary`: the first step with a
non-finite row, the columns), so a converted run answers "first NaN/inf" from its footers as a
run written as Parquet does. The query layer reads the result exactly as it read the CSV files
(``tests/test_query.py`` checks the answers agree).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.layout import PARQUET_SUFFIX
from trainprobe.engine.sinks.parquet_summary import NON_OPS, SUMMARY_KEY, Summary, encode
from trainprobe.tools.query import _read_csv, literal, quote, require
from trainprobe.tools.query_files import clean_length, csv_header, find_run_files
from trainprobe.tools.query_sql import TEXT_COLUMNS, bad_rows_sql


def convert_run(run: str | Path, remove_csv: bool = False) -> list[Path]:
    """Write the Parquet file of every CSV data file of ``run``; returns the files written.

    Raises:
        ConfigError: ``run`` holds no CSV data file; DuckDB is not installed.
    """
    duck = require("duckdb")
    con = duck.connect()
    written: list[Path] = []
    csv_files = [f for f in find_run_files(run) if f.format == "csv"]
    if not csv_files:
        raise ConfigError(f"run: no CSV data file under {str(run)!r} to convert")
    for f in csv_files:
        header = csv_header(f.path)
        if header is None:
            continue
        target = f.path.with_suffix(PARQUET_SUFFIX)
        convert_file(con, f.path, header, target)
        written.append(target)
        if remove_csv:
            f.path.unlink()
    return written


def convert_file(con: object, path: Path, header: tuple[str, ...], target: Path) -> None:
    """``path`` (CSV with ``header``) as Parquet at ``target`` (written under a temporary name)."""
    cut = clean_length(path)
    source = str(path)
    temp_csv: str | None = None
    if cut is not None:  # a torn last record: read the complete part only
        fd, temp_csv = tempfile.mkstemp(suffix=".csv", prefix="trainprobe-torn-")
        with open(path, "rb") as handle, os.fdopen(fd, "wb") as out:
            out.write(handle.read(cut))
        source = temp_csv
    partial = target.with_name(f".{target.name}.partial")
    try:
        columns = ", ".join(quote(h) for h in header)
        con.execute(  # type: ignore[attr-defined]
            f"CREATE OR REPLACE TEMP TABLE __convert AS SELECT {columns} FROM {_read_csv([source], header)} "
            "ORDER BY ordinality"
        )
        write_parquet(con, "__convert", header, partial)
        os.replace(partial, target)
    finally:
        con.execute("DROP TABLE IF EXISTS __convert")  # type: ignore[attr-defined]
        if temp_csv is not None:
            os.unlink(temp_csv)
        if partial.exists():
            partial.unlink()


def write_parquet(con: object, table: str, header: tuple[str, ...], path: Path) -> None:
    """Table ``table`` of ``con`` (a data file's columns ``header``, rows in file order) as the
    Parquet file ``path``, with its summary in the footer."""
    ops = [h for h in header if h not in NON_OPS]
    bad = bad_rows_sql(["step", *ops, *(t for t in TEXT_COLUMNS if t in header)])
    [(first_bad, rows)] = con.execute(  # type: ignore[attr-defined]
        f"SELECT min(step) FILTER (WHERE {bad}), count(*) FROM {quote(table)}"
    ).fetchall()
    summary = encode(Summary(None if first_bad is None else int(first_bad), header, int(rows)))
    columns = ", ".join(quote(h) for h in header)
    con.execute(  # type: ignore[attr-defined]
        f"COPY (SELECT {columns} FROM {quote(table)}) TO {literal(str(path))} "
        f"(FORMAT parquet, KV_METADATA {{{SUMMARY_KEY}: {literal(summary)}}})"
    )
