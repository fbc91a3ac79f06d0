"""The DuckDB engine (:class:`DuckEngine`): one connection holding the views of one run or more,
the :class:`~trainprobe.tools.engines.base.Engine` that ``diagnose`` and ``diff`` run on by default.

A run attached as :data:`~trainprobe.tools.engines.base.MAIN` (``diagnose``) has its views under
the tables' own names; with a :class:`Staging` they are staged in schemas
(:data:`RAW_SCHEMA`: the query layer's views; :data:`KEPT_SCHEMA`: the rank-local rows that count,
GradScaler's exempt rows left out; the current schema: the views the queries read, a sharded
run's full tensors with ``full``). A run attached as another side (``diff``'s ``b``, ``c``,
``n``) has its views in the schema of that name (``b."module"``), a sharded run's merged rows as
``<table>__merged`` (:data:`MERGED_SUFFIX`) when ``merge_shards`` is set. The views of
:data:`~trainprobe.tools.engines.base.MAIN` are narrowed to the steps a query needs
(:meth:`DuckEngine.narrow`: files outside them are not opened); every side's files are checked
again when its views are made (:func:`~trainprobe.tools.runs.files.check_unchanged`), and
:meth:`DuckEngine.seal` locks the connection to them (:mod:`~trainprobe.tools.engines.lock`).

Example::

    engine = DuckEngine("monitor_output")        # one run, as MAIN
    engine.seal()
    engine.fetch("SELECT max(norm) FROM weight_grad")
    engine.release()
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainprobe.tools.engines.base import MAIN
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.sql.names import ident, text

RAW_SCHEMA = "rank_local"
"""A staged run (:class:`Staging`): the schema of its views as the query layer defines them."""
KEPT_SCHEMA = "kept"
"""A staged run: the rank-local rows that count (the exempt ones left out)."""
MERGED_SUFFIX = "__merged"
"""A table's full-tensor rows in a side's schema (``b.weight_grad__merged``), its own columns."""


@dataclass(frozen=True)
class Staging:
    """How :data:`~trainprobe.tools.engines.base.MAIN`'s views are staged (module docstring).

    Attributes:
        full: the views the queries read are a sharded run's full tensors
            (:func:`~trainprobe.tools.sql.full.full_view_sql`, a NaN/inf copy of a replicated
            piece preferred) where a table has a layout; else the kept rank-local rows.
        exempt: view → SQL true for its rows that are not anomalies (GradScaler's skipped
            steps), or None.
    """

    full: bool
    exempt: Callable[[str], str | None]


@dataclass
class _Attached:
    """A run attached to the engine: its folder, its data files, the steps its views hold."""

    root: Path
    files: list[RunFile]
    steps: tuple[int, int] | None


class DuckEngine:
    """DuckDB over runs' files (CSV or Parquet); see the module docstring.

    Args:
        run: a run to attach as :data:`~trainprobe.tools.engines.base.MAIN` now (None: none yet).
        files: its data files, found already.
        con: the connection to use (None: a new in-memory one, closed by :meth:`release`).
        staging: how MAIN's views are staged (None: the query layer's views as they are).
        memory_limit: DuckDB's memory limit for a new connection (it spills beyond it).
        spill: give a new connection a private temporary folder (0700) for spilling a large
            join and for :meth:`write_csv`, removed by :meth:`release`.
        merge_shards: read a sharded side's tables (not MAIN's) through their merged rows
            (:meth:`merged`), unless :meth:`seal` finds every side of one layout.
        insertion_order: keep DuckDB's ``preserve_insertion_order`` (off: a large join needs
            less memory, and its rows come in no particular order unless ordered).
    """

    def __init__(
        self,
        run: str | Path | None = None,
        files: Sequence[RunFile] | None = None,
        con: Any = None,
        *,
        staging: Staging | None = None,
        memory_limit: str | None = None,
        spill: bool = False,
        merge_shards: bool = False,
        insertion_order: bool = True,
    ) -> None:
        from trainprobe.tools.query.layer import require

        self.owned = con is None
        self.con = require("duckdb").connect(
            config={"memory_limit": memory_limit} if memory_limit else {}) if con is None else con
        self.con.execute("SET enable_progress_bar = false")  # DuckDB would draw it on stdout for long queries
        if not insertion_order:
            self.con.execute("SET preserve_insertion_order = false")
        self.spill: Path | None = None
        if spill and self.owned:
            self.spill = Path(tempfile.mkdtemp(prefix="trainprobe-duckdb-"))
            self.con.execute(f"SET temp_directory = {text(str(self.spill))}")
        self.staging = staging
        self.merge_shards = merge_shards
        self._runs: dict[str, _Attached] = {}
        self._merged: set[tuple[str, str]] = set()
        if run is not None:
            self.attach(MAIN, run, files=files)

    @property
    def full(self) -> bool:
        """Whether MAIN's views are full tensors (a :class:`Staging` with ``full``)."""
        return self.staging is not None and self.staging.full

    # ---------------------------------------------------------------- runs and their views

    def attach(
        self, side: str, run: str | Path, steps: tuple[int, int] | None = None, files: Sequence[RunFile] | None = None
    ) -> dict[str, list[str]]:
        """``run``'s views as side ``side`` (see the module docstring); table → columns.

        Raises:
            ConfigError: a side attached twice; the run's files cannot be read or changed since
                they were found (one line naming the file).
        """
        from trainprobe.engine.errors import ConfigError
        from trainprobe.tools.runs.files import find_run_files

        if side in self._runs:
            raise ConfigError(f"engine: side {side!r} is attached already")
        found = list(files) if files is not None else find_run_files(run)
        self._runs[side] = _Attached(Path(run).expanduser(), found, steps)
        if side == MAIN:
            self._make_main(steps)
        else:
            self.con.execute(f"CREATE SCHEMA {ident(side)}")
            self._in_schema(side, lambda: self._connect(self._runs[side], steps))
            if self.merge_shards:
                self._use_full_tensors(side)
        return self.views(side)

    def views(self, side: str = MAIN) -> dict[str, list[str]]:
        """Side ``side``'s views (not its full-tensor or merged views): table → column names."""
        from trainprobe.tools.sql.full import FULL_COMMENT

        schema = "main" if side == MAIN else side
        rows = self.con.execute(
            "SELECT view_name FROM duckdb_views() WHERE NOT internal AND NOT temporary AND schema_name = ? "
            "AND comment IS DISTINCT FROM ? AND NOT suffix(view_name, ?) ORDER BY 1",
            [schema, FULL_COMMENT, MERGED_SUFFIX],
        ).fetchall()
        return {str(v): self._columns_of(schema, str(v)) for (v,) in rows}

    def ref(self, side: str, table: str) -> str:
        """``"table"`` for MAIN; ``side."table"`` (or its merged view, :meth:`merged`) for another side."""
        from trainprobe.tools.sql.diff import schema_ref

        if side == MAIN:
            return ident(table)
        return schema_ref(side, table + MERGED_SUFFIX if (side, table) in self._merged else table)

    def narrow(self, first: int, last: int) -> None:
        """Replace MAIN's views by views of steps ``first``..``last``: narrowed to them when some
        file of the run lies outside them (those files are then not opened), else the whole run.
        Tables kept earlier stay; ``file_row`` is numbered over the new views, so queries
        comparing it must read the same views."""
        attached = self._runs[MAIN]
        outside = any(f.first_step > last or f.last_step < first for f in attached.files)
        steps = (first, last) if outside else None
        if steps != attached.steps:
            attached.steps = steps
            self._make_main(steps)

    def merged(self, side: str) -> list[str]:
        """The tables of side ``side`` compared as full tensors (merged shards)."""
        return sorted(t for s, t in self._merged if s == side)

    def seal(self) -> None:
        """Check the attached runs' files again (:func:`~trainprobe.tools.runs.files.check_unchanged`)
        and lock the connection to them (and the spill folder,
        :func:`~trainprobe.tools.engines.lock.lock`); with ``merge_shards``, keep the merged
        views only where the sides' layouts differ (runs of one layout compare rank by rank, as
        written, so that a fault on one replica is not hidden by the merge, which counts a
        replicated tensor once)."""
        from trainprobe.tools.engines.lock import lock
        from trainprobe.tools.runs.files import check_unchanged

        sides = [s for s in self._runs if s != MAIN]
        if self._merged and sides and all(self.layout(s) == self.layout(sides[0]) for s in sides):
            self._merged.clear()
        files = [f for r in self._runs.values() for f in r.files]
        check_unchanged(files)  # again just before the first query: views open their paths when read
        lock(self.con, [f.path for f in files], spill=self.spill)

    def layout(self, side: str = MAIN) -> list[tuple[Any, ...]]:
        """Side ``side``'s layout entries (every rank's, sorted), [] for a run without layout files."""
        from trainprobe.tools.sql.full import LAYOUT_TABLE

        schema = side if side != MAIN else RAW_SCHEMA if self.staging is not None else "main"
        [(known,)] = self.con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE schema_name = ? AND table_name = ? AND NOT temporary",
            [schema, LAYOUT_TABLE],
        ).fetchall()
        if not known:
            return []
        return list(self.con.execute(f"SELECT * FROM {ident(schema)}.{ident(LAYOUT_TABLE)} ORDER BY ALL").fetchall())

    def ranks(self, side: str = MAIN) -> list[int]:
        """The ranks whose files side ``side`` holds (sorted)."""
        return sorted({f.rank for f in self._runs[side].files})

    def rank_local_entries(self, side: str = MAIN) -> list[tuple[int, str, str, str | None]]:
        """Side ``side``'s layout entries of kind ``rank_local`` (each rank's own value: unreduced
        gradients under data parallelism, activations of several ranks) as ``(rank, monitor,
        name, scope)``, sorted; [] for a run without layout files."""
        from trainprobe.engine.tensor_layout import RANK_LOCAL

        return sorted({(int(r[0]), str(r[1]), str(r[2]), r[3]) for r in self.layout(side) if r[4] == RANK_LOCAL},
                      key=lambda e: (e[0], e[1], e[2], e[3] or ""))

    # ---------------------------------------------------------------- queries

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql``."""
        return list(self.con.execute(sql).fetchall())

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""
        result = self.con.execute(sql)
        names = [d[0] for d in result.description]
        return [dict(zip(names, row)) for row in result.fetchall()]

    def arrays(self, sql: str) -> dict[str, Any]:
        """The columns of ``sql`` as NumPy arrays (masked where NULL)."""
        return dict(self.con.execute(sql).fetchnumpy())

    def columns(self, sql: str) -> list[str]:
        """The column names of ``sql``'s rows (none computed)."""
        return [d[0] for d in self.con.execute(f"SELECT * FROM ({sql}) LIMIT 0").description]

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` as the temporary table ``name``."""
        self.con.execute(f"CREATE TEMP TABLE {ident(name)} AS {sql}")

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        """``rows`` as the temporary table ``name`` (types ``VARCHAR``, ``BIGINT``, ``DOUBLE``)."""
        import pyarrow as pa

        types = {"VARCHAR": pa.string(), "BIGINT": pa.int64(), "DOUBLE": pa.float64()}
        table = pa.table({c: pa.array([r[i] for r in rows], type=types[t]) for i, (c, t) in enumerate(columns)})
        self.con.register("__trainprobe_rows", table)
        try:
            picked = ", ".join(f"CAST({ident(c)} AS {t}) AS {ident(c)}" for c, t in columns)
            self.con.execute(f"CREATE TEMP TABLE {ident(name)} AS SELECT {picked} FROM __trainprobe_rows")
        finally:
            self.con.unregister("__trainprobe_rows")

    def view(self, name: str, sql: str) -> None:
        """``sql`` as the temporary view ``name`` (computed where read)."""
        self.con.execute(f"CREATE TEMP VIEW {ident(name)} AS {sql}")

    def write_csv(self, sql: str, path: Path) -> None:
        """The rows of ``sql`` as CSV at ``path``, written by DuckDB into the spill folder (the one
        path a sealed connection may write) and copied atomically.

        Raises:
            ConfigError: the engine has no spill folder (``spill=True``)."""
        from trainprobe.engine.errors import ConfigError
        from trainprobe.engine.sinks.files import write_atomically

        if self.spill is None:
            raise ConfigError("engine: write_csv needs an engine made with spill=True")
        made = self.spill / "result.csv"
        self.con.execute(f"COPY ({sql}) TO {text(str(made))} (HEADER, DELIMITER ',')")
        try:
            with made.open("rb") as source:
                write_atomically(path, lambda out: shutil.copyfileobj(source, out, 1 << 20), field="-o/--output")
        finally:
            made.unlink()

    # ---------------------------------------------------------------- MAIN's rank-local rows

    def fetch_local(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` over MAIN's kept rank-local views (each rank's rows as written, the
        exempt ones left out); :meth:`fetch` for an engine without staging."""
        return self._local(lambda: self.fetch(sql))

    def arrays_local(self, sql: str) -> dict[str, Any]:
        """:meth:`arrays` over MAIN's kept rank-local views."""
        return self._local(lambda: self.arrays(sql))

    def keep_local(self, name: str, sql: str) -> None:
        """:meth:`keep` over MAIN's kept rank-local views."""
        self._local(lambda: self.keep(name, sql))

    def local(self) -> LocalRows:
        """This engine reading MAIN's kept rank-local views (for the spike scan of each rank's rows)."""
        return LocalRows(self)

    def release(self) -> None:
        """Close the connection if the engine opened it; remove its spill folder."""
        if self.owned:
            self.con.close()
        if self.spill is not None:
            shutil.rmtree(self.spill, ignore_errors=True)

    # ---------------------------------------------------------------- internals

    def _local(self, run: Callable[[], Any]) -> Any:
        return run() if self.staging is None else self._in_schema(KEPT_SCHEMA, run)

    def _in_schema(self, schema: str, run: Callable[[], Any]) -> Any:
        self.con.execute(f"USE {ident(schema)}")
        try:
            return run()
        finally:
            self.con.execute("USE main")

    def _connect(self, attached: _Attached, steps: tuple[int, int] | None) -> None:
        """The query layer's views of ``attached`` (in ``steps``) in the current schema."""
        from trainprobe.tools.query.layer import connect

        connect(attached.root, connection=self.con, steps=steps, files=attached.files)

    def _make_main(self, steps: tuple[int, int] | None) -> None:
        attached = self._runs[MAIN]
        if self.staging is None:
            self._connect(attached, steps)
        else:
            self._stage(attached, steps, self.staging)

    def _stage(self, attached: _Attached, steps: tuple[int, int] | None, staging: Staging) -> None:
        """MAIN's views staged in :data:`RAW_SCHEMA`, :data:`KEPT_SCHEMA` and ``main``."""
        from trainprobe.tools.sql.full import FULL_COMMENT, FULL_SUFFIX, full_view_sql

        for schema in (RAW_SCHEMA, KEPT_SCHEMA):
            self.con.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        self._in_schema(RAW_SCHEMA, lambda: self._connect(attached, steps))
        raw = self._views_of(RAW_SCHEMA)
        fulls = {v.removesuffix(FULL_SUFFIX) for v, c in raw if c == FULL_COMMENT}
        for view, comment in raw:
            if comment == FULL_COMMENT:
                continue
            columns = self._columns_of(RAW_SCHEMA, view)
            left_out = staging.exempt(view)
            where = f" WHERE NOT coalesce({left_out}, FALSE)" if left_out else ""
            kept = f"{KEPT_SCHEMA}.{ident(view)}"
            self.con.execute(f"CREATE OR REPLACE VIEW {kept} AS SELECT * FROM {RAW_SCHEMA}.{ident(view)}{where}")
            shown = f"SELECT * FROM {kept}"
            if staging.full and view in fulls:
                merged = full_view_sql(view, columns, RAW_SCHEMA, source=kept, nonfinite_first=True)
                shown = f"SELECT {', '.join(ident(c) for c in columns)} FROM ({merged})"
            self.con.execute(f"CREATE OR REPLACE VIEW main.{ident(view)} AS {shown}")

    def _use_full_tensors(self, side: str) -> None:
        """For each table of ``side`` with a full-tensor view (a sharded run,
        :mod:`~trainprobe.tools.sql.full`), its merged rows under the table's own columns, so
        that a sharded run compares with an unsharded one (or another layout) tensor by tensor."""
        from trainprobe.tools.sql.full import FULL_COMMENT, FULL_SUFFIX

        for full, comment in self._views_of(side):
            if comment != FULL_COMMENT:
                continue
            table = full.removesuffix(FULL_SUFFIX)
            cols = ", ".join(ident(c) for c in self._columns_of(side, table))
            self.con.execute(
                f"CREATE OR REPLACE VIEW {ident(side)}.{ident(table + MERGED_SUFFIX)} AS "
                f"SELECT {cols} FROM {ident(side)}.{ident(full)}"
            )
            self._merged.add((side, table))

    def _views_of(self, schema: str) -> list[tuple[str, str | None]]:
        return [
            (str(v), c)
            for v, c in self.con.execute(
                "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal AND NOT temporary "
                "AND schema_name = ? ORDER BY 1",
                [schema],
            ).fetchall()
        ]

    def _columns_of(self, schema: str, view: str) -> list[str]:
        return [
            str(c)
            for (c,) in self.con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE schema_name = ? AND table_name = ? "
                "AND database_name = current_database() ORDER BY column_index",
                [schema, view],
            ).fetchall()
        ]


class LocalRows:
    """A :class:`DuckEngine` whose queries read MAIN's kept rank-local views (its tables kept
    are temporary tables, shared with the engine): the :class:`~trainprobe.tools.engines.base.Rows`
    the spike scan of each rank's rows reads."""

    def __init__(self, engine: DuckEngine) -> None:
        self.engine = engine

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """:meth:`DuckEngine.fetch_local`."""
        return self.engine.fetch_local(sql)

    def arrays(self, sql: str) -> dict[str, Any]:
        """:meth:`DuckEngine.arrays_local`."""
        return self.engine.arrays_local(sql)

    def keep(self, name: str, sql: str) -> None:
        """:meth:`DuckEngine.keep_local`."""
        self.engine.keep_local(name, sql)

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        """:meth:`DuckEngine.keep_rows` (a temporary table: the same from either schema)."""
        self.engine.keep_rows(name, columns, rows)
