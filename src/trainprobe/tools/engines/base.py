"""The one interface of the engines the tools run their SQL on: :class:`Engine`.

Two engines implement it: DuckDB on this machine
(:class:`~trainprobe.tools.engines.duckdb_engine.DuckEngine`, the default) and Apache Spark
(:class:`~trainprobe.tools.engines.spark_engine.SparkEngine`, ``--engine spark``, a run's
Parquet files). ``trainprobe diagnose`` attaches one run, as the side :data:`MAIN` (its views
under the tables' own names); ``trainprobe diff`` attaches two or three, as the sides ``b``
(baseline), ``c`` (candidate) and ``n`` (a rerun, ``--noise``), and names their views through
:meth:`Engine.ref`. The queries are written once, in DuckDB's dialect
(:mod:`trainprobe.tools.sql`); Spark reads them through
:func:`~trainprobe.tools.engines.spark.to_spark`.

Example::

    from trainprobe.tools.engines.duckdb_engine import DuckEngine

    engine = DuckEngine()
    views = engine.attach("b", "run_a")          # table -> columns
    engine.seal()                                 # reads the run's files only from now on
    engine.fetch(f"SELECT count(*) FROM {engine.ref('b', 'weight_grad')}")
    engine.release()
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from trainprobe.tools.runs.files import RunFile

ENGINES = ("duckdb", "spark")
"""The engines ``--engine`` names."""
MAIN = ""
"""The side of a run attached alone (``diagnose``): its views under the tables' own names."""


class Rows(Protocol):
    """What a scan over rows asks (the spike scan, :mod:`trainprobe.tools.diagnosis.spikes`):
    an :class:`Engine`, or its rank-local rows (:meth:`Engine.local`)."""

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        """The rows of ``sql`` (DuckDB's dialect)."""

    def arrays(self, sql: str) -> dict[str, Any]:
        """The columns of ``sql`` as NumPy arrays (NULL as NaN, or masked, in float columns)."""

    def keep(self, name: str, sql: str) -> None:
        """The rows of ``sql`` kept as the table ``name`` for later queries."""

    def keep_rows(self, name: str, columns: Sequence[tuple[str, str]], rows: Sequence[tuple[Any, ...]]) -> None:
        """``rows`` kept as the table ``name`` with ``columns`` (name, SQL type)."""


class Engine(Rows, Protocol):
    """Where the tools' SQL runs; every method works on every engine (one that has nothing to
    do for it, such as Spark's :meth:`seal`, says so in its docstring)."""

    @property
    def full(self) -> bool:
        """Whether the :data:`MAIN` side's views are a sharded run's full tensors (the
        rank-local rows are then read through :meth:`fetch_local`)."""

    def attach(
        self, side: str, run: str | Path, steps: tuple[int, int] | None = None, files: Sequence[RunFile] | None = None
    ) -> dict[str, list[str]]:
        """``run``'s views as side ``side`` (:data:`MAIN`, or ``b``, ``c``, ``n``), holding at
        least ``steps`` (None: all); ``files``: its data files, found already. Table → columns."""

    def views(self, side: str = MAIN) -> dict[str, list[str]]:
        """Side ``side``'s views: table → column names."""

    def ref(self, side: str, table: str) -> str:
        """The SQL name of side ``side``'s view of ``table``."""

    def narrow(self, first: int, last: int) -> None:
        """From now on, :data:`MAIN`'s views hold at least steps ``first`` to ``last`` (maybe only those)."""

    def seal(self) -> None:
        """Every run attached: from now on the engine reads their files only and writes nothing
        but its own outputs (:mod:`~trainprobe.tools.engines.lock`)."""

    def records(self, sql: str) -> list[dict[str, Any]]:
        """The rows of ``sql`` as column name → value."""

    def columns(self, sql: str) -> list[str]:
        """The column names of ``sql``'s rows."""

    def view(self, name: str, sql: str) -> None:
        """``sql`` as the view ``name`` (computed where read, or once: an engine's choice)."""

    def write_csv(self, sql: str, path: Path) -> None:
        """The rows of ``sql`` as a CSV file with a header (NULL an empty cell), written atomically."""

    def fetch_local(self, sql: str) -> list[tuple[Any, ...]]:
        """:meth:`fetch` over :data:`MAIN`'s rank-local rows (each rank's rows as written)."""

    def local(self) -> Rows:
        """This engine reading :data:`MAIN`'s rank-local rows (the engine itself where its views
        are rank-local already)."""

    def layout(self, side: str = MAIN) -> list[tuple[Any, ...]]:
        """Side ``side``'s layout entries (:data:`~trainprobe.tools.sql.full.LAYOUT_TABLE`, every
        rank's), [] for a run without layout files."""

    def merged(self, side: str) -> list[str]:
        """The tables of side ``side`` read as full tensors (shards merged)."""

    def release(self) -> None:
        """Drop what the engine made (a Spark session may be the user's; a DuckDB connection
        passed in stays open)."""
