"""Where ``trainprobe diagnose`` runs its SQL: DuckDB on this machine (the default) or Apache
Spark (``--engine spark``, a run's Parquet files, on a cluster or in local mode).

Both run the same queries of :mod:`trainprobe.tools.sql.diagnose` and
:mod:`trainprobe.tools.diagnosis.spikes` (written once in DuckDB's dialect; Spark gets them
through :func:`trainprobe.tools.engines.spark.to_spark`): an engine only says which views a run
has, runs a query (its rows, or its columns as NumPy arrays for the spike rule's replay), and
keeps a query's rows (or rows made here: the spikes found) under a name for the next queries. DuckDB also narrows its views to the steps a query needs (files outside them are not
opened); Spark's views cover the whole run and the queries' own ``WHERE step`` conditions
prune its Parquet reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainprobe.tools.runs.files import RunFile

ENGINES = ("duckdb", "spark")

_Spark = TypeVar("_Spark", bound="SparkEngine")


class DiagnoseEngine(Protocol):
    """What :func:`trainprobe.tools.diagnosis.answer.diagnose` asks of an engine."""

    def views(self) -> dict[str, list[str]]:
        """View → its column names."""

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (DuckDB's dialect)."""

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` kept as the table ``name`` for later queries."""

    def arrays(self, sql: str) -> dict[str, Any]:
        """The columns of ``sql`` as NumPy arrays (NULL as NaN, or masked, in float columns)."""

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        """``rows`` kept as the table ``name`` with ``columns`` (name, SQL type)."""

    def narrow(self, first: int, last: int) -> None:
        """From now on, views holding at least steps ``first`` to ``last`` (maybe only those)."""


class DuckEngine:
    """DuckDB over the run's files (CSV or Parquet) on ``con``; see the module docstring."""

    def __init__(self, root: Path, files: Sequence[RunFile], con: Any, steps: tuple[int, int] | None = None) -> None:
        self.root, self.files, self.con, self.steps = root, files, con, steps
        self._connect(steps)

    def views(self) -> dict[str, list[str]]:
        from trainprobe.tools.query.layer import describe

        return {v: [c for c, _ in cols] for v, cols in describe(self.con).items()}

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return list(self.con.execute(sql).fetchall())

    def records(self, sql: str) -> list[dict[str, Any]]:
        result = self.con.execute(sql)
        names = [d[0] for d in result.description]
        return [dict(zip(names, row)) for row in result.fetchall()]

    def keep(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE TEMP TABLE {name} AS {sql}")

    def arrays(self, sql: str) -> dict[str, Any]:
        return dict(self.con.execute(sql).fetchnumpy())

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        import pyarrow as pa

        from trainprobe.tools.sql.names import ident

        types = {"VARCHAR": pa.string(), "BIGINT": pa.int64(), "DOUBLE": pa.float64()}
        table = pa.table(
            {c: pa.array([r[i] for r in rows], type=types[t]) for i, (c, t) in enumerate(columns)}
        )
        self.con.register("__trainprobe_rows", table)
        try:
            picked = ", ".join(f"CAST({ident(c)} AS {t}) AS {ident(c)}" for c, t in columns)
            self.con.execute(f"CREATE TEMP TABLE {name} AS SELECT {picked} FROM __trainprobe_rows")
        finally:
            self.con.unregister("__trainprobe_rows")

    def narrow(self, first: int, last: int) -> None:
        """Replace the connection's views by views of steps ``first``..``last``: narrowed to them
        when some file of the run lies outside them (those files are then not opened), else the
        whole run. Tables kept earlier stay; ``file_row`` is numbered over the new views, so
        queries comparing it must read the same views."""
        outside = any(f.first_step > last or f.last_step < first for f in self.files)
        steps = (first, last) if outside else None
        if steps != self.steps:
            self._connect(steps)
            self.steps = steps

    def _connect(self, steps: tuple[int, int] | None) -> None:
        from trainprobe.tools.query.layer import connect

        connect(self.root, connection=self.con, files=self.files, steps=steps)


RAW_SCHEMA = "rank_local"
""":class:`StagedDuckEngine`: the schema of the run's views as the query layer defines them."""
KEPT_SCHEMA = "kept"
""":class:`StagedDuckEngine`: the rank-local rows that count (the exempt ones left out)."""


class StagedDuckEngine(DuckEngine):
    """DuckDB over views of the run's rows, staged in schemas: the query layer's views in
    :data:`RAW_SCHEMA`; in :data:`KEPT_SCHEMA` the rank-local rows minus those of ``exempt``
    (view → SQL true for its rows that are not anomalies, or None: GradScaler's skipped steps); and in the
    current schema, the views the queries read: with ``full``, the full-tensor rows of each
    view with a layout (:func:`~trainprobe.tools.sql.full.full_view_sql`, a NaN/inf copy of a
    replicated piece preferred), else the kept rows. :meth:`fetch_local` reads the kept
    rank-local rows instead (which rank held what)."""

    def __init__(
        self, root: Path, files: Sequence[RunFile], con: Any, *, full: bool, exempt: Callable[[str], str | None]
    ) -> None:
        self.full, self.exempt = full, exempt
        for schema in (RAW_SCHEMA, KEPT_SCHEMA):
            con.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        super().__init__(root, files, con)

    def _connect(self, steps: tuple[int, int] | None) -> None:
        from trainprobe.tools.sql.full import FULL_COMMENT, FULL_SUFFIX, full_view_sql
        from trainprobe.tools.sql.names import ident

        self.con.execute(f"USE {RAW_SCHEMA}")
        try:
            super()._connect(steps)
        finally:
            self.con.execute("USE main")
        fulls = {v.removesuffix(FULL_SUFFIX) for v, c in self._views_of(RAW_SCHEMA) if c == FULL_COMMENT}
        for view, comment in self._views_of(RAW_SCHEMA):
            if comment == FULL_COMMENT:
                continue
            columns = self._columns_of(RAW_SCHEMA, view)
            left_out = self.exempt(view)
            where = f" WHERE NOT coalesce({left_out}, FALSE)" if left_out else ""
            kept = f"{KEPT_SCHEMA}.{ident(view)}"
            self.con.execute(f"CREATE OR REPLACE VIEW {kept} AS SELECT * FROM {RAW_SCHEMA}.{ident(view)}{where}")
            shown = f"SELECT * FROM {kept}"
            if self.full and view in fulls:
                merged = full_view_sql(view, columns, RAW_SCHEMA, source=kept, nonfinite_first=True)
                shown = f"SELECT {', '.join(ident(c) for c in columns)} FROM ({merged})"
            self.con.execute(f"CREATE OR REPLACE VIEW main.{ident(view)} AS {shown}")

    def _views_of(self, schema: str) -> list[tuple[str, str | None]]:
        return [
            (str(v), c)
            for v, c in self.con.execute(
                "SELECT view_name, comment FROM duckdb_views() WHERE NOT internal AND schema_name = ? ORDER BY 1",
                [schema],
            ).fetchall()
        ]

    def _columns_of(self, schema: str, view: str) -> list[str]:
        return [
            str(c)
            for (c,) in self.con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE schema_name = ? AND table_name = ? ORDER BY column_index",
                [schema, view],
            ).fetchall()
        ]

    def views(self) -> dict[str, list[str]]:
        return {v: self._columns_of("main", v) for v, _ in self._views_of("main")}

    def fetch_local(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` over the kept rank-local views (each rank's rows as written, the
        exempt ones left out)."""
        self.con.execute(f"USE {KEPT_SCHEMA}")
        try:
            return self.fetch(sql)
        finally:
            self.con.execute("USE main")

    def keep_local(self, name: str, sql: str) -> None:
        """:meth:`keep` over the kept rank-local views."""
        self.con.execute(f"USE {KEPT_SCHEMA}")
        try:
            self.keep(name, sql)
        finally:
            self.con.execute("USE main")

    def arrays_local(self, sql: str) -> dict[str, Any]:
        """:meth:`arrays` over the kept rank-local views."""
        self.con.execute(f"USE {KEPT_SCHEMA}")
        try:
            return self.arrays(sql)
        finally:
            self.con.execute("USE main")

    def local(self) -> LocalRows:
        """This engine reading the kept rank-local views (for the spike scan of each rank's rows)."""
        return LocalRows(self)

    def layout(self) -> list[tuple[Any, ...]]:
        """Every rank's layout entries (:data:`~trainprobe.tools.sql.full.LAYOUT_TABLE`), [] without."""
        from trainprobe.tools.sql.full import LAYOUT_TABLE

        [(known,)] = self.con.execute(
            "SELECT count(*) FROM duckdb_tables() WHERE schema_name = ? AND table_name = ?", [RAW_SCHEMA, LAYOUT_TABLE]
        ).fetchall()
        if not known:
            return []
        return list(self.con.execute(f"SELECT * FROM {RAW_SCHEMA}.{LAYOUT_TABLE}").fetchall())


class LocalRows:
    """A :class:`StagedDuckEngine` whose queries read the kept rank-local views (its tables kept
    are temporary tables, shared with the engine)."""

    def __init__(self, engine: StagedDuckEngine) -> None:
        self.engine = engine

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return self.engine.fetch_local(sql)

    def arrays(self, sql: str) -> dict[str, Any]:
        return self.engine.arrays_local(sql)

    def keep(self, name: str, sql: str) -> None:
        self.engine.keep_local(name, sql)

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        self.engine.keep_rows(name, columns, rows)


class SparkEngine:
    """Spark over the run's Parquet files (:func:`trainprobe.tools.engines.spark.register_views`)."""

    def __init__(self, session: Any, root: Path | None = None) -> None:
        """``root``: the run whose views are registered now (None: none yet, a subclass adds them)."""
        from trainprobe.tools.engines.spark import register_views

        self.session = session
        self._kept: dict[str, Any] = {}
        self._views: dict[str, list[str]] = {}
        if root is not None:
            self._views = {v: [c for c, _ in cols] for v, cols in register_views(session, root).items()}

    def views(self) -> dict[str, list[str]]:
        return self._views

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        from trainprobe.tools.engines.spark import to_spark

        return [tuple(row) for row in self.session.sql(to_spark(sql)).collect()]

    def records(self, sql: str) -> list[dict[str, Any]]:
        from trainprobe.tools.engines.spark import to_spark

        return [row.asDict() for row in self.session.sql(to_spark(sql)).collect()]

    def keep(self, name: str, sql: str) -> None:
        from trainprobe.tools.engines.spark import to_spark

        frame = self.session.sql(to_spark(sql)).cache()  # read by several queries: computed once
        frame.createOrReplaceTempView(name)
        self._kept[name] = frame

    def arrays(self, sql: str) -> dict[str, Any]:
        """The columns of ``sql``, through Arrow (``DataFrame.toArrow``, pyspark 4) or pandas."""
        import numpy as np

        from trainprobe.tools.engines.spark import to_spark

        frame = self.session.sql(to_spark(sql))
        if hasattr(frame, "toArrow"):
            table = frame.toArrow()
            return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
        pandas = frame.toPandas()
        return {c: np.asarray(pandas[c]) for c in pandas.columns}

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        schema = ", ".join(f"`{c}` {'STRING' if t == 'VARCHAR' else t}" for c, t in columns)
        frame = self.session.createDataFrame(list(rows), schema=schema).cache()
        frame.createOrReplaceTempView(name)
        self._kept[name] = frame

    def release(self) -> None:
        """Drop the tables :meth:`keep` made and free their cache (the session may be the user's)."""
        for name, frame in self._kept.items():
            frame.unpersist()
            self.session.catalog.dropTempView(name)
        self._kept.clear()

    def narrow(self, first: int, last: int) -> None:
        """Nothing: the queries' own ``WHERE step`` conditions prune Spark's Parquet reads."""


@contextmanager
def on_spark(session: Any, make: Callable[[Any], _Spark], failure: str) -> Iterator[_Spark]:
    """The engine ``make`` builds on ``session`` (None: the active session or one in local mode,
    stopped at the end if this started it, :func:`~trainprobe.tools.engines.spark.local_session`),
    released at the end. A Spark error in the block becomes one ConfigError line,
    ``"<failure>: <Spark's message>"`` (Spark's errors, py4j's and the analyser's, share no base)."""
    from trainprobe.engine.errors import ConfigError
    from trainprobe.tools.engines.spark import local_session
    from trainprobe.tools.query.layer import short_error

    with local_session() if session is None else nullcontext(session) as spark:
        engine = make(spark)
        try:
            yield engine
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring
            raise ConfigError(f"{failure}: {short_error(str(exc))}") from None
        finally:
            engine.release()
