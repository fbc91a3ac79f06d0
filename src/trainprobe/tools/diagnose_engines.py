"""Where ``trainprobe diagnose`` runs its SQL: DuckDB on this machine (the default) or Apache
Spark (``--engine spark``, a run's Parquet files, on a cluster or in local mode).

Both run the same queries of :mod:`trainprobe.tools.diagnose_sql` (written once in DuckDB's
dialect; Spark gets them through :func:`trainprobe.tools.query_spark.to_spark`): an engine only
says which views a run has, runs a query, and keeps a query's rows under a name for the next
queries. DuckDB also narrows its views to the steps a query needs (files outside them are not
opened); Spark's views cover the whole run and the queries' own ``WHERE step`` conditions
prune its Parquet reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol, TypeVar

from trainprobe.tools.query_files import RunFile

ENGINES = ("duckdb", "spark")

_Spark = TypeVar("_Spark", bound="SparkEngine")


class DiagnoseEngine(Protocol):
    """What :func:`trainprobe.tools.diagnose.diagnose` asks of an engine."""

    def views(self) -> dict[str, list[str]]:
        """View → its column names."""

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (DuckDB's dialect)."""

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` kept as the table ``name`` for later queries."""

    def narrow(self, first: int, last: int) -> None:
        """From now on, views holding at least steps ``first`` to ``last`` (maybe only those)."""


class DuckEngine:
    """DuckDB over the run's files (CSV or Parquet) on ``con``; see the module docstring."""

    def __init__(self, root: Path, files: Sequence[RunFile], con: Any, steps: tuple[int, int] | None = None) -> None:
        from trainprobe.tools.query import connect

        self.root, self.files, self.con, self.steps = root, files, con, steps
        connect(root, connection=con, files=files, steps=steps)

    def views(self) -> dict[str, list[str]]:
        from trainprobe.tools.query import describe

        return {v: [c for c, _ in cols] for v, cols in describe(self.con).items()}

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return list(self.con.execute(sql).fetchall())

    def records(self, sql: str) -> list[dict[str, Any]]:
        result = self.con.execute(sql)
        names = [d[0] for d in result.description]
        return [dict(zip(names, row)) for row in result.fetchall()]

    def keep(self, name: str, sql: str) -> None:
        self.con.execute(f"CREATE TEMP TABLE {name} AS {sql}")

    def narrow(self, first: int, last: int) -> None:
        """Replace the connection's views by views of steps ``first``..``last``: narrowed to them
        when some file of the run lies outside them (those files are then not opened), else the
        whole run. Tables kept earlier stay; ``file_row`` is numbered over the new views, so
        queries comparing it must read the same views."""
        from trainprobe.tools.query import connect

        outside = any(f.first_step > last or f.last_step < first for f in self.files)
        steps = (first, last) if outside else None
        if steps != self.steps:
            connect(self.root, connection=self.con, files=self.files, steps=steps)
            self.steps = steps


class SparkEngine:
    """Spark over the run's Parquet files (:func:`trainprobe.tools.query_spark.register_views`)."""

    def __init__(self, session: Any, root: Path | None = None) -> None:
        """``root``: the run whose views are registered now (None: none yet, a subclass adds them)."""
        from trainprobe.tools.query_spark import register_views

        self.session = session
        self._kept: dict[str, Any] = {}
        self._views: dict[str, list[str]] = {}
        if root is not None:
            self._views = {v: [c for c, _ in cols] for v, cols in register_views(session, root).items()}

    def views(self) -> dict[str, list[str]]:
        return self._views

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        from trainprobe.tools.query_spark import to_spark

        return [tuple(row) for row in self.session.sql(to_spark(sql)).collect()]

    def records(self, sql: str) -> list[dict[str, Any]]:
        from trainprobe.tools.query_spark import to_spark

        return [row.asDict() for row in self.session.sql(to_spark(sql)).collect()]

    def keep(self, name: str, sql: str) -> None:
        from trainprobe.tools.query_spark import to_spark

        frame = self.session.sql(to_spark(sql)).cache()  # read by several queries: computed once
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
    stopped at the end if this started it, :func:`~trainprobe.tools.query_spark.local_session`),
    released at the end. A Spark error in the block becomes one ConfigError line,
    ``"<failure>: <Spark's message>"`` (Spark's errors, py4j's and the analyser's, share no base)."""
    from trainprobe.engine.errors import ConfigError
    from trainprobe.tools.query import short_error
    from trainprobe.tools.query_spark import local_session

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
