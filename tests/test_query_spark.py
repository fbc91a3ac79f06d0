"""The query layer on Apache Spark (local mode): the same views and the same first NaN/inf as on
DuckDB, from the same Parquet files, the query defined once and transpiled by sqlglot.

Skipped without pyspark (not in ``[all]``: ``make test-spark`` installs ``[spark]`` and runs
this file; see the README for why)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyspark")
pytest.importorskip("sqlglot")

from monitor_runs import NAN_RANK, NAN_STEP  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.query import connect, describe  # noqa: E402
from trainprobe.tools.query_convert import convert_run  # noqa: E402
from trainprobe.tools.query_spark import register_views, spark_session, to_spark  # noqa: E402
from trainprobe.tools.query_sql import STAGES, first_bad_step_sql, first_nonfinite_sql  # noqa: E402


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    session = spark_session()
    yield session
    session.stop()


def _parquet_copy(run: Path, target: Path) -> Path:
    shutil.copytree(run, target)
    convert_run(target, remove_csv=True)
    return target


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_first_nonfinite_is_the_same_on_both_engines(
    monitor_runs: Any, tmp_path: Path, spark: Any, layout: str
) -> None:
    run = _parquet_copy(getattr(monitor_runs, layout), tmp_path / layout)
    con = connect(run)
    duck_views = describe(con)
    spark_views = register_views(spark, run)
    assert {v: [c for c, _ in cols] for v, cols in spark_views.items()} == {
        v: [c for c, _ in cols] for v, cols in duck_views.items()
    }
    names = {v: [c for c, _ in cols] for v, cols in duck_views.items()}
    [(step,)] = con.execute(first_bad_step_sql(names)).fetchall()
    assert spark.sql(to_spark(first_bad_step_sql(names))).collect()[0][0] == step == NAN_STEP
    sql = first_nonfinite_sql(names, step, limit=4)
    duck_rows = con.execute(sql).fetchall()
    spark_rows = [tuple(r) for r in spark.sql(to_spark(sql)).collect()]
    assert repr(spark_rows) == repr(duck_rows)
    assert (duck_rows[0][2], duck_rows[0][4], duck_rows[0][6]) == (NAN_STEP, NAN_RANK, "fc2.bias")
    total = "SELECT rank, step, count(*) AS n, sum(norm) AS s FROM {v} GROUP BY rank, step ORDER BY rank, step"
    for view in duck_views:
        want = con.execute(total.format(v=view)).fetchall()
        got = [tuple(r) for r in spark.sql(to_spark(total.format(v=view))).collect()]
        assert [g[:3] for g in got] == [w[:3] for w in want]
        assert all(g[3] == pytest.approx(w[3], nan_ok=True) for g, w in zip(got, want))


def test_cli_engine_spark_and_csv_only_runs(
    monitor_runs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ConfigError, match="has CSV only; convert it first: trainprobe convert"):
        register_views(None, monitor_runs.v2)
    run = _parquet_copy(monitor_runs.v2, tmp_path / "v2")
    assert main(["query", str(run), "--first-nonfinite", "--engine", "spark", "--csv"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("table,stage,step,micro_step,rank,vpp_stage,name")
    assert lines[1].split(",")[:7] == ["weight_grad", str(STAGES["weight_grad", "reduced"]), str(NAN_STEP), "1", str(NAN_RANK), "0", "fc2.bias"]
