"""``trainprobe report --engine spark``: the report's rows read through Apache Spark.

The run's Parquet files are registered as the query layer's views on a Spark session
(:func:`trainprobe.tools.engines.spark.register_views`: the same columns as on DuckDB) and each
file's rows are read with the report's SELECT list
(:func:`~trainprobe.tools.reporting.read.select_items`, transpiled to Spark SQL), one Spark query
per file, in file order, into the same :class:`~trainprobe.tools.reporting.read.FileRows` the
DuckDB reader gives (so the same collector digests them): memory is bounded by one file.

Spark reads Parquet only: a run holding CSV files is refused with one line saying how to convert
it (``trainprobe convert RUN --to parquet``); a sharded run's full tensors are merged on DuckDB
only (``--rank-local`` reads each rank's rows on Spark). Needs the ``[spark]`` extra and Java.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.read import FileRows, file_rows, op_columns, select_items
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.runs.read import parquet_only


@dataclass
class SparkRowReader:
    """Reads report files through a Spark session on which the run's views are registered
    (``tables``: table → its view's columns). The same interface as the DuckDB reader
    (:class:`~trainprobe.tools.reporting.full.RowReader`): rank-local rows, ``full`` None."""

    session: Any
    tables: dict[str, list[str]]
    full: None = None

    def read(self, files: Sequence[RunFile]) -> Iterator[tuple[RunFile, FileRows]]:
        """``(file, its rows)`` for each of ``files``, in their order.

        Raises:
            ConfigError: Spark could not read a file (the message names it, on one line).
        """
        from trainprobe.tools.engines.spark import to_spark
        from trainprobe.tools.sql.names import ident, text

        for file in files:
            columns = self.tables[file.table]
            ops = op_columns(columns)
            sql = (
                f"SELECT {select_items(ops, columns)} FROM {ident(file.table)} "
                f"WHERE file = {text(str(file.path))} ORDER BY file_row"
            )
            try:
                got = self.session.sql(to_spark(sql)).toArrow()
            except Exception as exc:  # noqa: BLE001 (Py4J and Spark errors have no common base: one line)
                raise ConfigError(f"{file.path}: Spark could not read it: {str(exc).strip().splitlines()[0][:300]}") from None
            yield file, file_rows(got, ops, file.layout == "v2", 0)

    def close(self) -> None:
        """Nothing to close: the session belongs to the caller."""


def spark_row_reader(session: Any, root: Path, files: Sequence[RunFile], full: bool) -> SparkRowReader:
    """A :class:`SparkRowReader` of ``files`` (the run ``root``'s) on ``session``.

    Raises:
        ConfigError: a file is CSV (Spark reads Parquet only), or ``full`` (the run is sharded
            and its full tensors were asked for).
    """
    from trainprobe.tools.engines.spark import register_views

    parquet_only(files)
    if full:
        raise ConfigError(
            "report --engine spark: a sharded run's full tensors are merged on DuckDB only; "
            "pass --rank-local to read each rank's rows on Spark, or use --engine duckdb"
        )
    views = register_views(session, root)
    return SparkRowReader(session, {table: [c for c, _ in columns] for table, columns in views.items()})
