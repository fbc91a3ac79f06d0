"""Where ``trainprobe diff`` joins two runs: DuckDB on this machine (the default) or Apache Spark
(``--engine spark``, the runs' Parquet files, on a cluster or in local mode).

Both run the same queries of :mod:`trainprobe.tools.sql.diff` (written once in DuckDB's dialect;
Spark gets them through :func:`trainprobe.tools.engines.spark.to_spark`). An engine holds both
runs' views (:meth:`DiffEngine.ref` names them: DuckDB's schemas ``b`` and ``c``, Spark's
temporary views ``__diff_b_<table>`` and ``__diff_c_<table>``), runs a query, keeps rows under
a name for later queries, and writes ``diff.csv``. DuckDB narrows each run's views to the
steps compared (files outside them are not opened); Spark's views cover the whole runs and the
queries' own ``WHERE step`` conditions prune its Parquet reads.
"""

from __future__ import annotations

import csv
import io
import shutil
import tempfile
from pathlib import Path
from typing import Any, Protocol

from trainprobe.tools.engines.diagnose import DuckEngine, SparkEngine
from trainprobe.tools.sql.diff import schema_ref
from trainprobe.tools.sql.full import FULL_COMMENT, FULL_SUFFIX
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.names import text as literal

MEMORY_LIMIT = "1GB"
"""DuckDB's memory for the join (it spills to the temporary folder beyond): the process stays
under 2 GB with runs of any size."""
MERGED_SUFFIX = "__merged"
"""A table's full-tensor rows in a diff schema (``b.weight_grad__merged``), its own columns."""
SPARK_PREFIX = "__diff_"
"""Spark's views of the two runs: ``__diff_b_<table>``, ``__diff_c_<table>``."""


class DiffEngine(Protocol):
    """What :func:`trainprobe.tools.rundiff.answer.diff` asks of an engine."""

    def attach(self, side: str, run: str | Path, steps: tuple[int, int] | None) -> dict[str, list[str]]:
        """``run``'s views as side ``side`` (``b`` or ``c``), holding at least ``steps``; table → columns."""

    def ref(self, side: str, table: str) -> str:
        """The SQL name of side ``side``'s view of ``table``."""

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (DuckDB's dialect)."""

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` kept as the table ``name`` for later queries."""

    def view(self, name: str, sql: str) -> None:
        """``sql`` as the view ``name`` (computed where read)."""

    def columns(self, sql: str) -> list[str]:
        """The column names of ``sql``'s rows."""

    def write_csv(self, sql: str, path: Path) -> None:
        """The rows of ``sql`` as a CSV file with a header (NULL an empty cell), written atomically."""

    def seal(self) -> None:
        """Both runs attached: from now on the engine reads their files only and writes nothing
        but its own outputs (:mod:`~trainprobe.tools.engines.lock`)."""

    def release(self) -> None:
        """Drop what the engine made (the Spark session may be the user's)."""


class DuckDiff(DuckEngine):
    """DuckDB: both runs' views on one connection of its own, in schemas ``b`` and ``c``."""

    def __init__(self) -> None:  # noqa: D107 - no run of its own: attach() adds them
        from trainprobe.tools.query.layer import require

        self.con = require("duckdb").connect()
        self.con.execute("SET preserve_insertion_order = false")
        self.con.execute(f"SET memory_limit = '{MEMORY_LIMIT}'")
        self.spill = Path(tempfile.mkdtemp(prefix="trainprobe-diff-"))  # private (0700): the join's spill, diff.csv
        self.con.execute(f"SET temp_directory = {literal(str(self.spill))}")
        self.readable: list[Path] = []  # both runs' files: all the locked connection may read
        self.rank_local = False  # True: compare rank-local rows even where full-tensor views exist
        self._merged: set[tuple[str, str]] = set()  # (side, table) read through its full-tensor rows
        self._sides: list[str] = []  # the runs attached: b, c (and n, a rerun)

    def attach(self, side: str, run: str | Path, steps: tuple[int, int] | None) -> dict[str, list[str]]:
        from trainprobe.tools.query.layer import connect
        from trainprobe.tools.runs.files import find_run_files

        run_files = find_run_files(run)
        self._sides.append(side)
        self.readable += [f.path for f in run_files]
        self.con.execute(f"CREATE SCHEMA {quote(side)}")
        self.con.execute(f"USE {quote(side)}")
        connect(run, self.con, steps=steps, files=run_files)
        self.con.execute("USE main")
        if not self.rank_local:
            self._use_full_tensors(side)
        found: dict[str, list[str]] = {}
        for (view,) in self.con.execute(
            f"SELECT view_name FROM duckdb_views() WHERE NOT internal AND schema_name = {literal(side)} "
            f"AND comment IS DISTINCT FROM {literal(FULL_COMMENT)} AND NOT suffix(view_name, {literal(MERGED_SUFFIX)}) "
            "ORDER BY 1"
        ).fetchall():
            cols = self.con.execute(f"SELECT column_name FROM duckdb_columns() WHERE schema_name = {literal(side)} "
                                    f"AND table_name = {literal(view)} ORDER BY column_index").fetchall()
            found[view] = [c[0] for c in cols]
        return found

    def _use_full_tensors(self, side: str) -> None:
        """For each table of ``side`` with a full-tensor view (a sharded run,
        :mod:`~trainprobe.tools.sql.full`), its merged rows under the table's own columns, so
        that a sharded run compares with an unsharded one (or another layout) tensor by tensor."""
        fulls = self.con.execute(
            f"SELECT view_name FROM duckdb_views() WHERE schema_name = {literal(side)} "
            f"AND comment = {literal(FULL_COMMENT)}"
        ).fetchall()
        for (full,) in fulls:
            table = full.removesuffix(FULL_SUFFIX)
            cols = [c for (c,) in self.con.execute(
                f"SELECT column_name FROM duckdb_columns() WHERE schema_name = {literal(side)} "
                f"AND table_name = {literal(table)} ORDER BY column_index").fetchall()]
            self.con.execute(
                f"CREATE OR REPLACE VIEW {quote(side)}.{quote(table + MERGED_SUFFIX)} AS "
                f"SELECT {', '.join(quote(c) for c in cols)} FROM {quote(side)}.{quote(full)}"
            )
            self._merged.add((side, table))

    def merged(self, side: str) -> list[str]:
        """The tables of ``side`` compared as full tensors (merged shards)."""
        return sorted(t for s, t in self._merged if s == side)

    def ref(self, side: str, table: str) -> str:
        return schema_ref(side, table + MERGED_SUFFIX if (side, table) in self._merged else table)

    def view(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE TEMP VIEW {name} AS {sql}")

    def columns(self, sql: str) -> list[str]:
        return [d[0] for d in self.con.execute(f"SELECT * FROM ({sql}) LIMIT 0").description]

    def write_csv(self, sql: str, path: Path) -> None:
        from trainprobe.engine.sinks.files import write_atomically

        made = self.spill / "diff.csv"
        self.con.execute(f"COPY ({sql}) TO {literal(str(made))} (HEADER, DELIMITER ',')")
        try:
            with made.open("rb") as source:
                write_atomically(path, lambda out: shutil.copyfileobj(source, out, 1 << 20), field="-o/--output")
        finally:
            made.unlink()

    def seal(self) -> None:
        """Lock the connection (:mod:`~trainprobe.tools.engines.lock`); and compare in full tensors
        only when the runs' layouts differ (a run's from the baseline's): runs of one layout
        compare rank by rank, as written, so that a fault on one replica (one DDP rank) is not
        hidden by the merge, which counts a replicated tensor once."""
        from trainprobe.tools.engines.lock import lock

        if self._merged and all(self._layout_of(s) == self._layout_of("b") for s in self._sides):
            self._merged.clear()
        lock(self.con, self.readable, spill=self.spill)

    def _layout_of(self, side: str) -> list[tuple[Any, ...]] | None:
        """Side ``side``'s layout entries (every rank's), or None for a run without layout files."""
        from trainprobe.tools.sql.full import LAYOUT_TABLE

        [(known,)] = self.con.execute(
            f"SELECT count(*) FROM duckdb_tables() WHERE schema_name = {literal(side)} "
            f"AND table_name = {literal(LAYOUT_TABLE)}"
        ).fetchall()
        if not known:
            return None
        return list(self.con.execute(f"SELECT * FROM {quote(side)}.{quote(LAYOUT_TABLE)} ORDER BY ALL").fetchall())

    def release(self) -> None:
        self.con.close()
        shutil.rmtree(self.spill, ignore_errors=True)


class SparkDiff(SparkEngine):
    """Spark: both runs' Parquet files as temporary views (:data:`SPARK_PREFIX`) on ``session``."""

    def __init__(self, session: Any) -> None:  # noqa: D107 - no run of its own: attach() adds them
        super().__init__(session)

    def attach(self, side: str, run: str | Path, steps: tuple[int, int] | None) -> dict[str, list[str]]:
        from trainprobe.tools.engines.spark import register_views

        found = {t: [c for c, _ in cols] for t, cols in register_views(self.session, run, prefix=self._prefix(side)).items()}
        return dict(sorted(found.items()))

    def _prefix(self, side: str) -> str:
        return f"{SPARK_PREFIX}{side}_"

    def ref(self, side: str, table: str) -> str:
        return quote(self._prefix(side) + table)

    def view(self, name: str, sql: str) -> None:
        self.keep(name, sql)  # read by several queries: computed once

    def columns(self, sql: str) -> list[str]:
        from trainprobe.tools.engines.spark import to_spark

        return list(self.session.sql(to_spark(sql)).columns)

    def write_csv(self, sql: str, path: Path) -> None:
        from trainprobe.engine.sinks.files import write_atomically
        from trainprobe.tools.engines.spark import to_spark

        frame = self.session.sql(to_spark(sql))

        def rows(out: Any) -> None:
            text = io.TextIOWrapper(out, encoding="utf-8", newline="")
            writer = csv.writer(text, lineterminator="\n")
            writer.writerow(frame.columns)
            for row in frame.toLocalIterator():
                writer.writerow(["" if v is None else _csv_value(v) for v in row])
            text.flush()
            text.detach()

        write_atomically(path, rows, field="-o/--output")

    def seal(self) -> None:
        """Nothing to lock on Spark: its views are registered from the runs' files only."""

    def release(self) -> None:
        super().release()
        for table in self.session.catalog.listTables():
            if table.isTemporary and table.name.startswith((SPARK_PREFIX, f"__src_{SPARK_PREFIX}")):
                self.session.catalog.dropTempView(table.name)


def _csv_value(value: Any) -> str:
    """A cell as DuckDB's ``COPY`` writes it (``true``, ``1.5``, ``inf``, ``nan``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
