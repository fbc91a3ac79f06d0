"""The report's reader: a run's data files found and read through the query layer
(:mod:`trainprobe.tools.query`), one file at a time, as numpy columns.

* Files: :func:`~trainprobe.tools.query_files.find_run_files` (Monitor V1 and V2, both tools'
  layouts, CSV or Parquet in any mix; a link to a file outside the folder given is skipped unread
  with one warning; entries that are not regular files are left out).
* Rows: the query layer's view of the one file (DuckDB's CSV/Parquet reader, no Python row
  loop): the V1 ``<vpp_stage>:`` chunk prefix dropped from names, an empty ``micro_step`` cell
  -1, an empty op cell NaN. A CSV file whose last record is torn (a run killed or still writing)
  is read without it: one warning names the file, and :attr:`FileRows.torn` counts it.
* A file DuckDB cannot read (not UTF-8, a cell that is not a number, a wrong number of cells) is a
  :class:`~trainprobe.engine.errors.ConfigError` naming the file, on one line.

Needs the ``[query]`` extra (DuckDB); without it, one line says how to install it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.query import quote, require, table_sql
from trainprobe.tools.query_files import NoRunFiles, RunFile, clean_length, find_run_files
from trainprobe.tools.query_sql import KEY_COLUMNS, META_COLUMNS, TEXT_COLUMNS

if TYPE_CHECKING:
    import duckdb


@dataclass(frozen=True)
class ReportFile:
    """One data file of the run.

    Attributes:
        path: the file.
        layout: ``v1`` or ``v2``.
        rank: the rank that wrote it.
        data_type: the V1 table or V2 monitor (``grad_reduced``, ``weight_grad``).
        run: the name of its run (V1) or rank (V2) folder.
        source: the query layer's description of the file.
    """

    path: Path
    layout: str
    rank: int
    data_type: str
    run: str
    source: RunFile


@dataclass
class FileRows:
    """The complete rows of one file, in file order.

    Attributes:
        ops: the op columns, in file order.
        steps, micro, vpp: int64 per row (``micro`` -1 where the file has none).
        values: ``(rows, ops)`` float64 (``nan``/``inf`` kept; an empty cell NaN).
        targets: the row's module or parameter name.
        scopes: V2: the row's scope; V1: None.
        shapes: the reference V1 ``shape`` text per row where the file has that column, else None.
        torn: 1 when the file's torn last record was left out, else 0.
    """

    ops: tuple[str, ...]
    steps: np.ndarray
    micro: np.ndarray
    vpp: np.ndarray
    values: np.ndarray
    targets: list[str]
    scopes: list[str] | None
    shapes: list[str] | None
    torn: int


def find_report_files(root: Path) -> list[ReportFile]:
    """Every data file under ``root``, by rank, data type, first step and folder.

    Raises:
        ConfigError: ``root`` missing or not a folder; no monitor file under it (``no monitor
            CSV found``, with what was looked for and the links skipped).
    """
    try:
        found = find_run_files(root)
    except NoRunFiles as exc:
        text = str(exc)
        raise ConfigError(
            "monitor_path: no monitor CSV found (nor Parquet) " + text.split("(.csv or .parquet) ", 1)[1]
        ) from None
    files = [ReportFile(f.path, f.layout, f.rank, f.table, f.path.parent.name, f) for f in found]
    return sorted(files, key=lambda f: (f.rank, f.data_type, f.source.first_step, f.run, f.source.format))


def connection() -> duckdb.DuckDBPyConnection:
    """A DuckDB connection for :func:`read_file` (ConfigError naming the ``[query]`` extra without DuckDB)."""
    return require("duckdb").connect()  # type: ignore[no-any-return]


def read_file(con: duckdb.DuckDBPyConnection, file: ReportFile) -> FileRows:
    """The complete rows of ``file`` (see the module docstring).

    Raises:
        ConfigError: ``<file>: ...`` on one line: a header naming a column twice or lacking the
            layout's key columns, text that is not UTF-8, a cell that is not a number.
    """
    import duckdb

    torn = int(file.source.format == "csv" and (clean_length(file.path) or 0) > 0)
    try:
        made = table_sql(con, file.data_type, [file.source])
        if made is None:
            return _empty(torn)
        view, names = made
        ops = tuple(c for c in names if c not in KEY_COLUMNS and c not in TEXT_COLUMNS and c not in META_COLUMNS)
        items = [
            "step",
            "coalesce(micro_step, -1) AS micro",
            "vpp_stage",
            "coalesce(name, '') AS name",
            "coalesce(scope, '') AS scope",
            *(f"coalesce({quote(op)}, CAST('nan' AS DOUBLE)) AS {quote('op_' + op)}" for op in ops),
            *(["shape"] if "shape" in names else []),
        ]
        got = con.execute(f"SELECT {', '.join(items)} FROM ({view}) ORDER BY file_row").fetchnumpy()
    except duckdb.Error as exc:
        raise ConfigError(f"{file.path}: {_reason(str(exc))}") from None
    n = len(got["step"])
    values = np.empty((n, len(ops)), dtype=np.float64)
    for column, op in enumerate(ops):
        values[:, column] = got["op_" + op]
    return FileRows(
        ops=ops,
        steps=np.asarray(got["step"], dtype=np.int64),
        micro=np.asarray(got["micro"], dtype=np.int64),
        vpp=np.asarray(got["vpp_stage"], dtype=np.int64),
        values=values,
        targets=got["name"].tolist(),
        scopes=got["scope"].tolist() if file.layout == "v2" else None,
        shapes=[str(s) for s in got["shape"].tolist()] if "shape" in got else None,
        torn=torn,
    )


def _empty(torn: int) -> FileRows:
    none = np.zeros(0, dtype=np.int64)
    return FileRows((), none, none, none, np.zeros((0, 0)), [], None, None, torn)


def _reason(message: str) -> str:
    """DuckDB's error as one short line: ``not UTF-8 text`` for an encoding error."""
    from trainprobe.tools.query import short_error

    flat = short_error(message)
    if "unicode" in flat.lower() or "utf-8" in flat.lower() or "utf8" in flat.lower():
        return f"not UTF-8 text ({flat[:200]})"
    return f"not a monitor file DuckDB can read ({flat[:300]})"
