"""The full tensors of a sharded run for ``trainprobe report``'s heatmaps, lines, rank comparison,
training curves and top offenders (FSDP2, tensor parallelism and their mixes: the run's
``tensor_layout.json`` files mark shards or replicas).

Each rank writes the statistics of its own piece of a parameter, gradient or optimizer moment.
For the tables that have layouts (V2 ``weight_grad``, ``param``, ``optimizer``) the report
reads instead one row per tensor, step, micro-step and scope: the query layer's full-tensor
view (:func:`~trainprobe.tools.sql.full.full_view_sql`: min/max exact, norm √Σ norm², mean
element-weighted, nans summed, replicas counted once), with the copy of a replicated piece that
holds a NaN/inf preferred (as ``trainprobe diagnose`` reads it), so a NaN on one replica is not
hidden. A merged row is filed under the least rank holding the tensor (the file and row of that
rank's piece), so the heatmaps' rank menu shows full tensors under that rank; rows that are never
merged (``unreduced`` gradients under FSDP, rank-local by nature) stay under their own rank.
Other tables (``module``, ``cc``) are read as written. ``trainprobe report --rank-local``
reads every rank's rows as written.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.read import (
    STREAM_ERRORS,
    FileRows,
    connection,
    read_files,
    run_files,
    select_items,
    stream_file_rows,
    torn_rows,
)
from trainprobe.tools.runs.files import RunFile

if TYPE_CHECKING:
    import duckdb


@dataclass
class FullViews:
    """A connection on the run with its full-tensor views; ``tables``: table → the columns of
    its rank-local view (the tables read in full tensors)."""

    con: Any
    tables: dict[str, list[str]]

    def read(self, files: Sequence[RunFile]) -> Iterator[tuple[RunFile, FileRows]]:
        """The full-tensor rows of ``files`` (all of :attr:`tables`), file by file in their order
        per table (see the module docstring).

        Raises:
            ConfigError: DuckDB could not read the run (the message names the table).
        """
        from trainprobe.tools.sql.full import full_view_sql
        from trainprobe.tools.sql.names import text
        from trainprobe.tools.sql.questions import ops_of

        for table in dict.fromkeys(f.data_type for f in files):
            batch = [f for f in files if f.data_type == table]
            columns = self.tables[table]
            ops = tuple(o for o in ops_of(columns) if o not in ("shape", "dtype"))
            order = ", ".join(f"({text(str(f.path))}, {n})" for n, f in enumerate(batch))
            sql = (
                f"SELECT {select_items(ops, [c for c in columns if c not in ('shape', 'dtype')])}, v.file "
                f"FROM ({full_view_sql(table, columns, nonfinite_first=True)}) v "
                f"JOIN (VALUES {order}) AS o(path, n) ON v.file = o.path ORDER BY o.n, v.file_row"
            )
            try:
                for file, rows in stream_file_rows(self.con, sql, batch, ops):
                    yield file, replace(rows, torn=torn_rows(file))
            except STREAM_ERRORS:
                raise ConfigError(f"{table}: the full tensors of this sharded run cannot be read; "
                                  "pass --rank-local to read each rank's rows as written") from None

    def close(self) -> None:
        """Close the connection."""
        self.con.close()


def full_views(root: Path, files: Sequence[RunFile]) -> FullViews | None:
    """The full-tensor views of ``root`` (a sharded V2 run), or None when it has none."""
    from trainprobe.tools.query.layer import connect, describe
    from trainprobe.tools.sql.full import FULL_SUFFIX

    con = connect(root, files=run_files(files))
    described = describe(con, full=True)
    tables = {
        name.removesuffix(FULL_SUFFIX): [c for c, _ in described[name.removesuffix(FULL_SUFFIX)]]
        for name in described
        if name.endswith(FULL_SUFFIX) and name.removesuffix(FULL_SUFFIX) in described
    }
    if not tables:
        con.close()
        return None
    return FullViews(con, tables)


@dataclass
class RowReader:
    """Reads the rows of report files: rank-local (:func:`~trainprobe.tools.reporting.read.read_files`)
    or, for the tables of ``full``, full tensors; ``torn`` counts a full table's torn rows
    (read as the query layer reads them)."""

    con: duckdb.DuckDBPyConnection
    full: FullViews | None = None

    def read(self, files: Sequence[RunFile]) -> Iterator[tuple[RunFile, FileRows]]:
        """``(file, rows)`` of every one of ``files``: rank-local files first, in their order, then
        the full-tensor ones."""
        merged = set(self.full.tables) if self.full is not None else set()
        yield from read_files(self.con, [f for f in files if f.data_type not in merged])
        if self.full is not None:
            yield from self.full.read([f for f in files if f.data_type in merged])

    def close(self) -> None:
        """Close the connections."""
        self.con.close()
        if self.full is not None:
            self.full.close()


def row_reader(root: Path, files: Sequence[RunFile], full: bool) -> RowReader:
    """A :class:`RowReader` of ``files``, with full tensors when ``full`` and the run has them."""
    return RowReader(connection(files), full_views(root, files) if full else None)
