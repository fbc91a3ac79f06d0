"""``trainprobe query RUN "SQL"`` and ``trainprobe convert RUN --to parquet``.

``query`` runs SQL against the views of :func:`trainprobe.tools.query.connect` and prints the
result as an aligned table (``--csv``, ``--json``: one JSON object per row); ``--schema`` lists
the views and their columns; ``--first-nonfinite`` prints the run's first NaN/inf in execution
order (:mod:`trainprobe.tools.query_sql`). ``--engine spark`` runs the same SQL on Apache Spark
in local mode over the run's Parquet files (transpiled by sqlglot; the ``[spark]`` extra).

``convert`` writes next to every CSV data file a Parquet file with the same name, columns and
rows (a torn last record left out), through DuckDB; ``--remove-csv`` deletes each CSV file once
its Parquet file is complete.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainprobe.tools.query import short_error

FIRST_COLUMNS = (
    "table", "stage", "step", "micro_step", "rank", "vpp_stage", "name", "scope", "op", "value", "file", "position"
)
"""The columns of ``--first-nonfinite``'s answer."""


def add_parser(sub: Any) -> None:
    """Add the ``query`` and ``convert`` sub-commands to ``sub``."""
    query = sub.add_parser(
        "query",
        help="run SQL on a run's monitor output (CSV or Parquet, V1 or V2), no import step",
        description="Run SQL against one view per table of a run (weight_grad, module, optimizer, param, cc; "
        "V1's actv, grad_reduced, ...), columns rank, step, micro_step, vpp_stage, name, scope, one per op, "
        "file, file_row. See docs/query.md. Needs: pip install 'trainprobe[query]'.",
    )
    query.add_argument("run_folder", metavar="RUN", help="the run folder (V2 output_dir, V1 MONITOR_OUTPUT_DIR, or one rank/run folder)")
    query.add_argument("sql", nargs="?", help="the SQL to run (DuckDB's dialect)")
    what = query.add_mutually_exclusive_group()
    what.add_argument("--schema", action="store_true", help="list the views and their columns")
    what.add_argument(
        "--first-nonfinite", action="store_true", help="the first NaN/inf of the run in execution order"
    )
    form = query.add_mutually_exclusive_group()
    form.add_argument("--csv", action="store_true", help="print CSV")
    form.add_argument("--json", action="store_true", help="print one JSON object per line")
    query.add_argument(
        "--engine", choices=("duckdb", "spark"), default="duckdb", help="duckdb (default) or spark (Parquet runs)"
    )
    query.set_defaults(run=_query_command)
    convert = sub.add_parser(
        "convert",
        help="convert a run's CSV files to Parquet (same names, columns and rows)",
        description="Write a .parquet file next to every monitor CSV file of RUN (either tool's layout). "
        "Needs: pip install 'trainprobe[query]'.",
    )
    convert.add_argument("run_dir", metavar="RUN", help="the run folder")
    convert.add_argument("--to", choices=("parquet",), default="parquet", help="target format (parquet)")
    convert.add_argument("--remove-csv", action="store_true", help="delete each CSV file once converted")
    convert.set_defaults(run=_convert_command)


def _query_command(args: argparse.Namespace) -> int:
    from trainprobe.engine.errors import ConfigError

    if not args.schema and not args.first_nonfinite and not args.sql:
        raise ConfigError("query: give the SQL to run, or --schema, or --first-nonfinite")
    names, rows = run_query(
        args.run_folder, args.sql, schema=args.schema, first=args.first_nonfinite, engine=args.engine
    )
    print_rows(names, rows, "csv" if args.csv else "json" if args.json else "table")
    return 0


def run_query(
    run: str | Path, sql: str | None, *, schema: bool = False, first: bool = False, engine: str = "duckdb"
) -> tuple[list[str], list[tuple[Any, ...]]]:
    """Column names and rows of the answer (see the module docstring)."""
    from trainprobe.engine.errors import ConfigError
    from trainprobe.tools.query_sql import first_bad_step_sql, first_nonfinite_sql

    if engine == "spark":
        from trainprobe.tools.query_spark import local_session, register_views, to_spark

        with local_session() as session:
            views = register_views(session, run)
            if schema:
                return ["view", "column", "type"], [(v, c, t) for v, cols in sorted(views.items()) for c, t in cols]
            names = {v: [c for c, _ in cols] for v, cols in views.items()}
            try:
                if first:
                    step = session.sql(to_spark(first_bad_step_sql(names))).collect()[0][0]
                    if step is None:
                        return list(FIRST_COLUMNS), []
                    sql = first_nonfinite_sql(names, step)
                frame = session.sql(to_spark(str(sql)))
                return list(frame.columns), [tuple(row) for row in frame.collect()]
            except Exception as exc:  # noqa: BLE001 - pyspark's errors share no base class worth naming
                raise ConfigError(f"the SQL failed on Spark: {' '.join(str(exc).split())[:500]}") from None
    from trainprobe.tools.query import connect, describe, first_nonfinite, require

    duckdb = require("duckdb")  # or a ConfigError saying how to install it
    if first and not schema:  # no views of every file needed (a Parquet run: its footers only)
        try:
            found = first_nonfinite(run)
        except duckdb.Error as exc:
            raise ConfigError(f"the SQL failed: {short_error(str(exc))}") from None
        return list(FIRST_COLUMNS), [tuple(row.values()) for row in found]
    con = connect(run)
    if schema:
        described = describe(con)
        return ["view", "column", "type"], [(v, c, t) for v, cols in described.items() for c, t in cols]
    try:
        result = con.execute(str(sql))
        return [d[0] for d in result.description], result.fetchall()
    except duckdb.Error as exc:
        raise ConfigError(f"the SQL failed: {short_error(str(exc))}") from None


def print_rows(names: Sequence[str], rows: Sequence[Sequence[Any]], form: str) -> None:
    """Print rows as an aligned table, CSV or JSON lines (NaN/inf as the strings ``nan``/``inf``)."""
    out = sys.stdout
    if form == "csv":
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(names)
        writer.writerows([[_cell(v) for v in row] for row in rows])
        return
    if form == "json":
        for row in rows:
            out.write(json.dumps({n: _json_value(v) for n, v in zip(names, row)}) + "\n")
        return
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(n), *(len(r[i]) for r in cells)]) for i, n in enumerate(names)]
    out.write("  ".join(n.ljust(w) for n, w in zip(names, widths)).rstrip() + "\n")
    out.write("  ".join("-" * w for w in widths) + "\n")
    for row in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() + "\n")
    out.write(f"({len(rows)} row{'s' if len(rows) != 1 else ''})\n")


def _cell(value: Any) -> str:
    if value is None:
        return "NULL"
    return repr(value) if isinstance(value, float) else str(value)


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)


def _convert_command(args: argparse.Namespace) -> int:
    from trainprobe.tools.query_convert import convert_run

    done = convert_run(args.run_dir, remove_csv=args.remove_csv)
    print(f"converted {len(done)} CSV file(s) to Parquet under {args.run_dir}")
    return 0
