"""The query layer on runs of many ranks (issue #26's targets; a benchmark, not a timed test).

1. A synthetic V2 ``weight_grad`` run of 32 ranks x 500 steps x 100 parameters x 2 scopes
   (3.2 M rows, CSV, one NaN; ``synthetic_runs.py``). "First NaN/inf in execution order" is
   answered by ``trainprobe.tools.query.layer`` (``connect`` + ``first_nonfinite``, view creation
   included) and by a bare DuckDB scan of the same files for the same question (``read_csv``
   with its type detection, a filter on every op, ``ORDER BY step LIMIT 1``): target, the layer
   within 2x of the bare scan.
2. The run converted to Parquet (``trainprobe convert``: the files users get from it or from
   ``"format": "parquet"``, footer summaries included), the same question again: target, at
   least 10x faster than from CSV.
   ``trainprobe report`` on the same CSV run (written to a temporary HTML page, the page's size
   printed): target, within 5x of the bare scan and at most 500 MB RSS.
   ``trainprobe csv2db`` of the same CSV run (a fresh database): target, within 5x of the bare
   first-NaN scan; also printed against a bare DuckDB scan of every column of the files into
   Arrow (what any converter must read), measured in the same run, and against csv2db's SQLite
   side alone (the same rows, read beforehand: storing, checking and indexing them, the floor of
   any reader in front of this writer).
3. 256 ranks x 2,000 steps x 100 parameters x 2 scopes = 102.4 M rows generated as Parquet by
   pyarrow directly (no footer summaries, so the layer scans the rows: its row path at scale):
   target, first NaN/inf in at most 30 s and 2 GB RSS (the query runs in a child process whose
   peak RSS is read from ``wait4``); rows/s printed.

Each query runs in a fresh child process (so the RSS is the query's, not the generator's), twice;
the faster run is reported, timed from after ``import duckdb`` and the layer's import (the same
for both sides) to the answer: the layer's time includes finding the files and creating the
views. The file cache is warm for both sides alike.

Usage::

    python bench/bench_query.py            # full run (about 10 minutes on 2 cores, ~3 GB of disk)
    python bench/bench_query.py --quick    # smoke run (small sizes)
    python bench/bench_query.py --keep /tmp/bq --only report   # the bare scan and the report only
    python bench/bench_query.py --keep /tmp/bq --only csv2db   # the CSV run, its bare scans and csv2db
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic_runs import Shape, write_csv_run, write_parquet_run  # noqa: E402

CHILD = r"""
import json, os, sys, time
kind, run = sys.argv[1], sys.argv[2]
import duckdb
from trainprobe.tools.query.layer import first_nonfinite
start, cpu = time.perf_counter(), os.times()  # after the imports (the same for both sides)
if kind.startswith("bare"):
    con = duckdb.connect()
    reader = "read_parquet" if kind == "bare_parquet" else "read_csv"
    pattern = "/rank_*/*.parquet" if kind == "bare_parquet" else "/rank_*/*.csv"
    rows = con.execute(
        f"SELECT filename, step, module_name, scope FROM {reader}(?, filename=true) "
        "WHERE isnan(min) OR isinf(min) OR isnan(max) OR isinf(max) OR isnan(mean) OR isinf(mean) "
        "OR isnan(norm) OR isinf(norm) OR nans > 0 ORDER BY step LIMIT 1",
        [run + pattern],
    ).fetchall()
    answer = [rows[0][1], rows[0][2], rows[0][3]]
else:
    [first] = first_nonfinite(run)
    answer = [first["step"], first["name"], first["scope"], first["rank"]]
done = os.times()
cpu = done.user - cpu.user + done.system - cpu.system  # every thread's
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": cpu, "answer": answer}))
"""


def measure(kind: str, run: Path, repeats: int = 2) -> dict[str, object]:
    """The fastest of ``repeats`` child runs of query ``kind`` on ``run``, with its peak RSS (MB)."""
    best: dict[str, object] | None = None
    for _ in range(repeats):
        proc = subprocess.Popen([sys.executable, "-c", CHILD, kind, str(run)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{kind} query failed on {run}")
        result = json.loads(out.strip().splitlines()[-1])
        result["rss_mb"] = usage.ru_maxrss / 1024
        if best is None or float(result["seconds"]) < float(best["seconds"]):  # type: ignore[arg-type]
            best = result
    assert best is not None
    return best


REPORT_CHILD = r"""
import json, os, sys, tempfile, time
from pathlib import Path
run = sys.argv[2]
import duckdb
from trainprobe.tools.reporting.report import write_report
start, cpu = time.perf_counter(), os.times()  # after the imports, as for the queries
with tempfile.TemporaryDirectory() as out:
    page = write_report(run, Path(out) / "report.html")
    size = page.stat().st_size
done = os.times()
cpu = done.user - cpu.user + done.system - cpu.system
print(json.dumps({"seconds": time.perf_counter() - start, "cpu": cpu, "answer": [size]}))
"""


def measure_report(run: Path, repeats: int = 2) -> dict[str, object]:
    """``trainprobe report`` on ``run`` in a child process: the fastest of ``repeats`` runs, with
    its peak RSS (MB) and the page's size in bytes (``answer``)."""
    best: dict[str, object] | None = None
    for _ in range(repeats):
        proc = subprocess.Popen(
            [sys.executable, "-c", REPORT_CHILD, "report", str(run)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        out = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"report failed on {run}")
        result = json.loads(out.strip().splitlines()[-1])
        result["rss_mb"] = usage.ru_maxrss / 1024
        if best is None or float(result["seconds"]) < float(best["seconds"]):  # type: ignore[arg-type]
            best = result
    assert best is not None
    return best


def print_report_row(run: Path, bare: dict[str, object]) -> None:
    """The ``report`` row: its time against the bare scan's (target <= 5x) and its RSS (<= 500 MB)."""
    report = measure_report(run)
    ratio = float(report["seconds"]) / float(bare["seconds"])  # type: ignore[arg-type]
    pages = report["answer"][0] / 1e6  # type: ignore[index]
    cpu = float(report["cpu"]) / float(bare["cpu"])  # type: ignore[arg-type]
    print(
        f"  report:            {report['seconds']:.2f} s, {report['rss_mb']:.0f} MB RSS, a {pages:.1f} MB page; "
        f"report / bare: {ratio:.1f}x (targets <= 5x, <= 500 MB); CPU {report['cpu']:.2f} s / {bare['cpu']:.2f} s "
        f"= {cpu:.1f}x; load average {os.getloadavg()[0]:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    parser.add_argument("--keep", help="keep the generated runs in this folder")
    parser.add_argument(
        "--only", choices=("report", "csv2db"), help="measure only this tool (with the bare scan it is compared to)"
    )
    args = parser.parse_args()
    small = Shape(ranks=4, steps=100, params=20, window=50, nan_rank=2, nan_step=61, nan_param=7)
    medium = Shape(ranks=32, steps=500, params=100, window=100, nan_rank=7, nan_step=321, nan_param=42)
    large = Shape(ranks=256, steps=2000, params=100, window=500, nan_rank=200, nan_step=1777, nan_param=13)
    csv_shape, big_shape = (small, small) if args.quick else (medium, large)
    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="trainprobe-bench-query-"))
    try:
        csv_run = base / "csv"
        t = time.perf_counter()
        if not csv_run.exists():
            write_csv_run(csv_run, csv_shape)
        size = sum(p.stat().st_size for p in csv_run.rglob("*.csv")) / 1e6
        print(f"CSV run: {csv_shape.rows:,} rows, {size:.0f} MB ({time.perf_counter() - t:.1f} s to generate)")
        bare = measure("bare", csv_run)
        if args.only == "report":
            print(
                f"  bare DuckDB scan:  {bare['seconds']:.2f} s ({bare['cpu']:.2f} s CPU), {bare['rss_mb']:.0f} MB RSS "
                f"-> {bare['answer']}"
            )
            print_report_row(csv_run, bare)
            return
        if args.only == "csv2db":
            print(f"  bare DuckDB scan:  {bare['seconds']:.2f} s, {bare['rss_mb']:.0f} MB RSS -> {bare['answer']}")
            print(csv2db_line(csv_run, bare))
            return
        layer = measure("layer", csv_run)
        print(f"  bare DuckDB scan:  {bare['seconds']:.2f} s, {bare['rss_mb']:.0f} MB RSS -> {bare['answer']}")
        print(f"  query layer:       {layer['seconds']:.2f} s, {layer['rss_mb']:.0f} MB RSS -> {layer['answer']}")
        ratio = float(layer["seconds"]) / float(bare["seconds"])  # type: ignore[arg-type]
        print(f"  layer / bare: {ratio:.2f}x (target <= 2x)")
        print(csv2db_line(csv_run, bare))
        print_report_row(csv_run, bare)
        parquet_run = base / "parquet"
        if not parquet_run.exists():
            shutil.copytree(csv_run, parquet_run)
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, "-m", "trainprobe", "convert", str(parquet_run), "--remove-csv"], check=True
            )
            size = sum(p.stat().st_size for p in parquet_run.rglob("*.parquet")) / 1e6
            print(f"  converted to Parquet in {time.perf_counter() - t:.1f} s: {size:.0f} MB")
        from_parquet = measure("layer", parquet_run)
        bare_parquet = measure("bare_parquet", parquet_run)
        speedup = float(layer["seconds"]) / float(from_parquet["seconds"])  # type: ignore[arg-type]
        print(
            f"  from Parquet:      {from_parquet['seconds']:.2f} s, {from_parquet['rss_mb']:.0f} MB RSS "
            f"-> {from_parquet['answer']}; CSV / Parquet {speedup:.1f}x (target >= 10x)"
        )
        print(f"  bare DuckDB scan of the Parquet files: {bare_parquet['seconds']:.2f} s -> {bare_parquet['answer']}")
        big = base / "big"
        t = time.perf_counter()
        if not big.exists():
            write_parquet_run(big, big_shape)
        size = sum(p.stat().st_size for p in big.rglob("*.parquet")) / 1e6
        print(f"Parquet run: {big_shape.rows:,} rows, {size:.0f} MB ({time.perf_counter() - t:.1f} s to generate)")
        result = measure("layer", big)
        seconds = float(result["seconds"])  # type: ignore[arg-type]
        print(
            f"  first NaN/inf: {seconds:.2f} s ({big_shape.rows / seconds / 1e6:.1f} M rows/s), "
            f"{result['rss_mb']:.0f} MB RSS -> {result['answer']} (targets <= 30 s, <= 2048 MB)"
        )
    finally:
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


CSV2DB_CHILD = r"""
import json, shutil, sys, time
kind, run, out = sys.argv[1], sys.argv[2], sys.argv[3]
import duckdb
from trainprobe.core.monitor.csv2db import CSV2DBConfig, csv2db
start = time.perf_counter()  # after the imports (the same for both sides)
if kind == "bare_all":  # every column of every file, as csv2db must read them
    con = duckdb.connect()
    con.execute("SET enable_progress_bar = false")
    reader = con.sql(f"SELECT * FROM read_csv('{run}/rank_*/*.csv', filename=true)").to_arrow_reader(1 << 17)
    rows = sum(batch.num_rows for batch in reader)
elif kind == "store_only":  # csv2db's SQLite side alone: every file read beforehand (not timed)
    from pathlib import Path
    from trainprobe.tools.exports.sqlite import DEFAULT_STEP_PARTITION
    from trainprobe.tools.runs.read import read_files
    from trainprobe.tools.exports.sqlite_schema import MetricsDatabase
    from trainprobe.tools.runs.selection import find_monitor_files
    parsed = list(read_files(find_monitor_files(Path(run), None, None, None)))
    shutil.rmtree(out, ignore_errors=True)
    Path(out).mkdir(parents=True)
    start = time.perf_counter()
    with MetricsDatabase(Path(out) / "monitor_metrics.db", DEFAULT_STEP_PARTITION) as db:
        rows = sum(db.add(one) for one in parsed)
        db.finish()
else:
    shutil.rmtree(out, ignore_errors=True)
    rows = csv2db(CSV2DBConfig(run, output_dirpath=out)).rows
print(json.dumps({"seconds": time.perf_counter() - start, "answer": rows}))
"""


def csv2db_line(csv_run: Path, bare_first: dict[str, object]) -> str:
    """csv2db of the CSV run (a fresh database) against the bare first-NaN scan measured before
    (``bare_first``: target <= 5x) and against a bare DuckDB scan of every column of the same files
    (each the faster of two fresh processes, measured here one after the other)."""
    out = csv_run.parent / "csv2db_out"
    times = {}
    for kind in ("bare_all", "store_only", "csv2db"):
        best = None
        for _ in range(2):
            done = subprocess.run(
                [sys.executable, "-c", CSV2DB_CHILD, kind, str(csv_run), str(out)],
                stdout=subprocess.PIPE, text=True, check=True,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            best = result if best is None or result["seconds"] < best["seconds"] else best
        assert best is not None
        times[kind] = best
    shutil.rmtree(out, ignore_errors=True)
    bare, store, conv = times["bare_all"], times["store_only"], times["csv2db"]
    first = float(bare_first["seconds"])  # type: ignore[arg-type]
    return (
        f"  csv2db: {conv['seconds']:.2f} s for {conv['answer']:,} rows: {conv['seconds'] / first:.1f}x the bare "
        f"first-NaN scan ({first:.2f} s; target <= 5x), {conv['seconds'] / bare['seconds']:.1f}x a bare DuckDB scan "
        f"of every column ({bare['seconds']:.2f} s, {bare['answer']:,} rows); load average "
        f"{os.getloadavg()[0]:.1f}\n"
        f"  csv2db's SQLite side alone (the rows read beforehand, not timed; stored, checked and indexed): "
        f"{store['seconds']:.2f} s = {store['seconds'] / first:.1f}x the bare first-NaN scan"
    )


if __name__ == "__main__":
    main()
