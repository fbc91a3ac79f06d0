"""The Spark engine (:class:`SparkEngine`): runs' Parquet files as Spark temporary views, the
:class:`~trainprobe.tools.engines.base.Engine` of ``--engine spark`` (on a cluster, or in local mode).

The queries are DuckDB's dialect, transpiled by :func:`~trainprobe.tools.engines.spark.to_spark`.
A run attached as :data:`~trainprobe.tools.engines.base.MAIN` has its views under the tables'
own names; another side's as ``__diff_<side>_<table>`` (:data:`SIDE_PREFIX`). Spark reads the
rank-local rows as written (no staging, no merged shards) and its views cover the whole run:
the queries' own ``WHERE step`` conditions prune its Parquet reads.

Example::

    with on_spark(None, "Spark could not read the run") as engine:
        engine.attach(MAIN, "monitor_output")
        engine.fetch("SELECT max(norm) FROM weight_grad")
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from trainprobe.tools.engines.base import MAIN
from trainprobe.tools.runs.files import RunFile
from trainprobe.tools.sql.names import ident

SIDE_PREFIX = "__diff_"
"""Spark's views of a side other than MAIN: ``__diff_b_<table>``, ``__diff_c_<table>``."""

class SparkEngine:
    """Spark over runs' Parquet files on ``session`` (see the module docstring); ``run``: a run
    to attach as MAIN now (None: none yet)."""

    def __init__(self, session: Any, run: str | Path | None = None) -> None:
        self.session = session
        self._kept: dict[str, Any] = {}
        self._views: dict[str, dict[str, list[str]]] = {}
        self._registered: set[str] = set()
        if run is not None:
            self.attach(MAIN, run)

    @property
    def full(self) -> bool:
        """Always False: Spark reads the rank-local rows as written."""
        return False

    def attach(
        self, side: str, run: str | Path, steps: tuple[int, int] | None = None, files: Sequence[RunFile] | None = None
    ) -> dict[str, list[str]]:
        """``run``'s Parquet files as side ``side``'s views (all steps: ``steps`` and ``files``
        are not needed, Spark finds and prunes the files itself); table → columns.

        Raises:
            ConfigError: the run has CSV files only (the message says how to convert them).
        """
        from trainprobe.tools.engines.spark import register_views

        before = self._temp_views()
        found = register_views(self.session, run, prefix=self._prefix(side))
        self._registered |= (self._temp_views() - before) | {self._prefix(side) + t for t in found}
        self._views[side] = {t: [c for c, _ in cols] for t, cols in sorted(found.items())}
        return dict(self._views[side])

    def views(self, side: str = MAIN) -> dict[str, list[str]]:
        """Side ``side``'s views: table → column names."""
        return dict(self._views.get(side, {}))

    def ref(self, side: str, table: str) -> str:
        """The quoted name of side ``side``'s view of ``table``."""
        return ident(self._prefix(side) + table)

    def narrow(self, first: int, last: int) -> None:
        """Nothing: the queries' own ``WHERE step`` conditions prune Spark's Parquet reads."""

    def seal(self) -> None:
        """Nothing to lock on Spark: its views are registered from the runs' files only (user SQL
        is checked instead, :func:`~trainprobe.tools.engines.spark.read_only`)."""

    def merged(self, side: str) -> list[str]:
        """None: Spark compares the rank-local rows."""
        return []

    def layout(self, side: str = MAIN) -> list[tuple[Any, ...]]:
        """[]: Spark does not read layout files."""
        return []

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (transpiled)."""
        return [tuple(row) for row in self._frame(sql).collect()]

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""
        return [row.asDict() for row in self._frame(sql).collect()]

    def arrays(self, sql: str) -> dict[str, Any]:
        """The columns of ``sql``, through Arrow (``DataFrame.toArrow``, pyspark 4) or pandas."""
        import numpy as np

        frame = self._frame(sql)
        if hasattr(frame, "toArrow"):
            table = frame.toArrow()
            return {c: table.column(c).to_numpy(zero_copy_only=False) for c in table.column_names}
        pandas = frame.toPandas()
        return {c: np.asarray(pandas[c]) for c in pandas.columns}

    def columns(self, sql: str) -> list[str]:
        """The column names of ``sql``'s rows (none computed)."""
        return list(self._frame(sql).columns)

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` cached as the temporary view ``name`` (computed once)."""
        frame = self._frame(sql).cache()
        frame.createOrReplaceTempView(name)
        self._kept[name] = frame

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        """``rows`` cached as the temporary view ``name`` with ``columns`` (name, SQL type)."""
        schema = ", ".join(f"`{c}` {'STRING' if t == 'VARCHAR' else t}" for c, t in columns)
        frame = self.session.createDataFrame(list(rows), schema=schema).cache()
        frame.createOrReplaceTempView(name)
        self._kept[name] = frame

    def view(self, name: str, sql: str) -> None:
        """:meth:`keep`: a view read by several queries is computed once."""
        self.keep(name, sql)

    def write_csv(self, sql: str, path: Path) -> None:
        """The rows of ``sql`` as CSV at ``path`` (cells as DuckDB's ``COPY`` writes them), atomically."""
        from trainprobe.engine.sinks.files import write_atomically

        frame = self._frame(sql)

        def rows(out: Any) -> None:
            wrapped = io.TextIOWrapper(out, encoding="utf-8", newline="")
            writer = csv.writer(wrapped, lineterminator="\n")
            writer.writerow(frame.columns)
            for row in frame.toLocalIterator():
                writer.writerow(["" if v is None else _csv_value(v) for v in row])
            wrapped.flush()
            wrapped.detach()

        write_atomically(path, rows, field="-o/--output")

    def fetch_local(self, sql: str) -> list[tuple[Any, ...]]:
        """:meth:`fetch`: Spark's views are rank-local already."""
        return self.fetch(sql)

    def local(self) -> SparkEngine:
        """The engine itself: its views are rank-local already."""
        return self

    def release(self) -> None:
        """Drop the tables kept and the views registered, and free their cache (the session may be the user's)."""
        for name, frame in self._kept.items():
            frame.unpersist()
            self.session.catalog.dropTempView(name)
        self._kept.clear()
        for name in sorted(self._registered):
            self.session.catalog.dropTempView(name)
        self._registered.clear()
        self._views.clear()

    def _prefix(self, side: str) -> str:
        return "" if side == MAIN else f"{SIDE_PREFIX}{side}_"

    def _frame(self, sql: str) -> Any:
        from trainprobe.tools.engines.spark import to_spark

        return self.session.sql(to_spark(sql))

    def _temp_views(self) -> set[str]:
        return {t.name for t in self.session.catalog.listTables() if t.isTemporary}


def _csv_value(value: Any) -> str:
    """A cell as DuckDB's ``COPY`` writes it (``true``, ``1.5``, ``inf``, ``nan``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@contextmanager
def on_spark(session: Any, failure: str) -> Iterator[SparkEngine]:
    """A :class:`SparkEngine` on ``session`` (None: the active session or one in local mode,
    stopped at the end if this started it, :func:`~trainprobe.tools.engines.spark.local_session`),
    released at the end. A Spark error in the block becomes one ConfigError line,
    ``"<failure>: <Spark's message>"`` (Spark's errors, py4j's and the analyser's, share no base)."""
    from trainprobe.engine.errors import ConfigError
    from trainprobe.tools.engines.spark import local_session
    from trainprobe.tools.query.layer import short_error

    with local_session() if session is None else nullcontext(session) as spark:
        engine = SparkEngine(spark)
        try:
            yield engine
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - see the docstring
            raise ConfigError(f"{failure}: {short_error(str(exc))}") from None
        finally:
            engine.release()
