"""``--engine spark`` on the commands that read a run's rows into their own collector: report,
csv2db and csv2tb read the same rows through Spark as through DuckDB (a real 2-rank V2 run,
converted to Parquet), and a CSV run is refused with one line before Spark starts.

Skipped without pyspark (``make test-spark``)."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyspark")
pytest.importorskip("sqlglot")

from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.engines.spark import spark_session  # noqa: E402
from trainprobe.tools.exports.sqlite import CSV2DBConfig, csv2db  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.reporting.data import load_report_data  # noqa: E402
from trainprobe.tools.reporting.report import write_report  # noqa: E402
from trainprobe.tools.runs.read import read_files, spark_read_files  # noqa: E402
from trainprobe.tools.runs.selection import find_monitor_files  # noqa: E402


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session()
    yield session
    session.stop()


@pytest.fixture(scope="module")
def parquet_run(monitor_runs: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("spark") / "v2"
    shutil.copytree(monitor_runs.v2, run)
    convert_run(run, remove_csv=True)
    return run


def _digest(data: Any) -> list[tuple[Any, ...]]:
    """What the collector made of the rows: per group and rank, the cells drawn and the counts."""
    return [
        (g.name, tuple(g.ops), tuple(g.targets), g.steps.tolist(), rank, m.rows, m.nonfinite_rows,
         np.nan_to_num(m.values, nan=-1.0, posinf=-2.0, neginf=-3.0).round(12).tolist(), m.nonfinite.tolist())
        for g in data.groups
        for rank, m in sorted(g.ranks.items())
    ]


def test_report_reads_the_same_rows_through_spark(parquet_run: Path, spark: Any, tmp_path: Path) -> None:
    duck = load_report_data(parquet_run)
    through_spark = load_report_data(parquet_run, spark=spark)
    assert _digest(through_spark) == _digest(duck)
    assert sum(m.rows for g in duck.groups for m in g.ranks.values()) > 0
    assert [e.key for e in through_spark.onsets] == [e.key for e in duck.onsets] and duck.onsets
    page = write_report(parquet_run, tmp_path / "spark.html", engine="spark")  # the active session, left running
    assert page.read_text().startswith("<!DOCTYPE html>") and not spark.sparkContext._jsc.sc().isStopped()


def test_csv2db_and_the_reader_give_the_same_rows_through_spark(parquet_run: Path, spark: Any, tmp_path: Path) -> None:
    files = find_monitor_files(parquet_run)
    for duck, through_spark in zip(read_files(files), spark_read_files(spark, files), strict=True):
        assert through_spark.file == duck.file and through_spark.ops == duck.ops
        assert through_spark.steps == duck.steps and through_spark.targets == duck.targets
        assert through_spark.target_index == duck.target_index and through_spark.nan_masks == duck.nan_masks
        assert np.array_equal(np.array(through_spark.values), np.array(duck.values), equal_nan=True)
    stored = []
    for engine in ("duckdb", "spark"):
        result = csv2db(CSV2DBConfig(monitor_path=str(parquet_run), output_dirpath=str(tmp_path / engine)),
                        engine=engine)
        assert result.rows > 0
        with sqlite3.connect(result.db_path) as db:
            tables = [t for (t,) in db.execute("SELECT table_name FROM partitions ORDER BY table_name")]
            stored.append({t: sorted(db.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables})
            stored[-1]["targets"] = sorted(db.execute("SELECT * FROM targets").fetchall(), key=repr)
    assert stored[0] == stored[1] and any(stored[0][t] for t in stored[0] if t != "targets")


def test_a_csv_run_is_refused_before_spark_starts(monitor_runs: Any, tmp_path: Path) -> None:
    for call in (
        lambda: write_report(monitor_runs.v2, tmp_path / "r.html", engine="spark"),
        lambda: csv2db(CSV2DBConfig(monitor_path=str(monitor_runs.v2), output_dirpath=str(tmp_path / "db")),
                       engine="spark"),
    ):
        with pytest.raises(ConfigError, match=r"^--engine spark reads Parquet files and \d+ selected file\(s\) are CSV"):
            call()
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "db" / "monitor_metrics.db").exists()
    with pytest.raises(ConfigError, match="engine: expected one of duckdb, spark, got 'sqlite'"):
        write_report(monitor_runs.v2, tmp_path / "r.html", engine="sqlite")


def test_query_takes_engine_spark_before_the_sql(
    parquet_run: Path, spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trainprobe query RUN --engine spark "SQL"``: the options before the SQL (the session
    of this module is the active one, so the command uses it and leaves it running)."""
    from trainprobe.cli import main
    from trainprobe.tools.query.layer import connect

    sql = "SELECT count(*) AS n FROM weight_grad"
    assert main(["query", str(parquet_run), "--engine", "spark", "--csv", sql]) == 0
    lines = capsys.readouterr().out.splitlines()
    (want,) = connect(parquet_run).execute(sql).fetchone()
    assert lines == ["n", str(want)] and want > 0
