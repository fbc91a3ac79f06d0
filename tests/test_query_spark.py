"""The query layer on Apache Spark (local mode): the same views, the same first NaN/inf and the
same ``trainprobe diagnose`` (spikes included) as on DuckDB, from the same Parquet files, each
query defined once and transpiled by sqlglot.

Skipped without pyspark (not in ``[all]``: ``make test-spark`` installs ``[spark]`` and runs
this file; see the README for why)."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyspark")
pytest.importorskip("sqlglot")

from diagnose_runs import BAD_RANK, SPIKE_PARAM, SPIKE_STEP, make_diagnose_runs  # noqa: E402
from diff_runs import SCALED, resumed_copy, train  # noqa: E402
from monitor_runs import NAN_RANK, NAN_STEP  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.diagnosis.answer import diagnose  # noqa: E402
from trainprobe.tools.engines.spark import register_views, spark_session, to_spark  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.query.layer import connect, describe  # noqa: E402
from trainprobe.tools.rundiff.answer import diff  # noqa: E402
from trainprobe.tools.sql.questions import STAGES, first_bad_step_sql, first_nonfinite_sql  # noqa: E402


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
    # user SQL on Spark: one read-only query over the run's views, else one line, exit 2
    assert main(["query", str(run), "SELECT count(*) AS n FROM weight_grad", "--engine", "spark", "--csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "n"
    target = tmp_path / "leak"
    for sql in (f"INSERT OVERWRITE DIRECTORY '{target}' SELECT * FROM weight_grad", "SELECT * FROM parquet.`/etc`"):
        assert main(["query", str(run), sql, "--engine", "spark"]) == 2
        assert "query:" in capsys.readouterr().err
    assert not target.exists()


def test_a_local_session_started_by_the_command_prints_no_spark_warnings(tmp_path: Path) -> None:
    """``trainprobe diagnose --engine spark`` in a fresh process starts Spark in local mode: the
    answer on stdout, and no Spark warnings or log-level advice on stderr (the JVM's own line
    about incubator modules is not Spark's to silence)."""
    import subprocess
    import sys

    folder = tmp_path / "run" / "rank_0"
    folder.mkdir(parents=True)
    (folder / "weight_grad_step0-1.csv").write_text(
        "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans\n"
        "0,0,w,reduced,0,-1,1,0,1,0\n0,1,w,reduced,0,-1,1,0,nan,1\n"
    )
    convert_run(tmp_path / "run", remove_csv=True)
    src = Path(__file__).resolve().parent.parent / "src"
    done = subprocess.run(
        [sys.executable, "-m", "trainprobe", "diagnose", str(tmp_path / "run"), "--engine", "spark"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(src)},
    )
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("first anomaly: step 1, rank 0"), done.stdout
    spark_lines = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: Using incubator modules")]
    assert spark_lines == [], done.stderr


def test_to_spark_rewrites_what_spark_reads_otherwise() -> None:
    """Spark refuses ``median`` over a window frame and reads no tuple as an ordering key."""
    window = to_spark("SELECT median(a) OVER (ORDER BY i ROWS BETWEEN 3 PRECEDING AND 1 PRECEDING) FROM t")
    assert "PERCENTILE(a, 0.5) OVER" in window and "MEDIAN" not in window
    assert "MIN_BY(name, STRUCT(file_row, k))" in to_spark("SELECT arg_min(name, (file_row, k)) FROM t")
    assert to_spark("SELECT median(a) FROM t") == "SELECT PERCENTILE(a, 0.5) FROM t"
    assert to_spark("SELECT hash(file) FROM t") == "SELECT XXHASH64(file) FROM t"  # 64 bits, as DuckDB's
    # RE2's group \1 is Java's $1; a literal $ is escaped for Java; the pattern is left as it is
    assert to_spark(r"SELECT regexp_replace(n, '(a)\.', 'x\1$\\', 'g') FROM t") == (
        r"SELECT REGEXP_REPLACE(n, '(a)\\.', 'x$1\\$\\\\') FROM t"
    )


def test_diagnose_gives_the_same_answer_on_both_engines(
    tmp_path: Path, spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real 2-rank runs with a 50x gradient spike and a NaN (``diagnose_runs.py``), as Parquet:
    ``diagnose(engine="spark")`` gives the document DuckDB gives, spike first; the CLI too."""
    runs = make_diagnose_runs(tmp_path / "runs")
    for layout in ("v2", "v1"):
        run = _parquet_copy(getattr(runs, layout), tmp_path / layout)
        on_duckdb = diagnose(run).to_json()
        assert diagnose(run, engine="spark", spark=spark).to_json() == on_duckdb
        first = on_duckdb["first"]
        assert (first["kind"], first["step"], first["rank"]) == ("spike", SPIKE_STEP, BAD_RANK), first
        assert first["name"].startswith(SPIKE_PARAM.rsplit(".", 1)[0]), first
        assert on_duckdb["first_nonfinite"] is not None
    assert main(["diagnose", str(tmp_path / "v2"), "--engine", "spark"]) == 1
    assert capsys.readouterr().out.splitlines()[0] == "first anomaly: " + diagnose(tmp_path / "v2").first.describe()
    assert spark.sql("SELECT 1").collect()[0][0] == 1  # the command used the active session and left it running
    with pytest.raises(ConfigError, match="has CSV only; convert it first"):
        diagnose(runs.v2, engine="spark", spark=spark)
    with pytest.raises(ConfigError, match="--engine: one of duckdb, spark, not 'polars'"):
        diagnose(runs.v2, engine="polars")


def _no_ids(text: str) -> str:
    """``text`` without the random ids Plotly gives its figures."""
    return re.sub(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", "ID", text)


def test_diff_gives_the_same_answer_on_both_engines(
    tmp_path: Path, spark: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Real trainings of the demo GPT (``diff_runs.py``), one with a weight scaled after step 5,
    as Parquet: ``diff(engine="spark")`` gives DuckDB's result, ``diff_summary.json``,
    ``diff.csv``, ``--html`` page and printed report, with a ``--map`` whose group reference (``\\1``) Spark
    must read as Java's ``$1``, and with ``--steps``/``--offset``; a CSV run is refused."""
    base = train(tmp_path / "csv_base", steps=7)
    scaled = train(tmp_path / "csv_scaled", steps=7, scale_after=5)
    b = _parquet_copy(base, tmp_path / "base")
    c = _parquet_copy(scaled, tmp_path / "scaled")
    mapping = {r"^layers\.([0-9]+)\.": r"layers.\1."}  # the identity, through a group
    for options in ({"exact": True, "mapping": mapping}, {"steps": (3, 6), "offset": 1, "ops": ["norm", "max"]}):
        html = options.get("exact", False)
        on_duckdb = diff(b, c, out=tmp_path / "duck", html=tmp_path / "duck" / "d.html" if html else None, **options)  # type: ignore[arg-type]
        on_spark = diff(b, c, out=tmp_path / "spark", html=tmp_path / "spark" / "d.html" if html else None,  # type: ignore[arg-type]
                        engine="spark", spark=spark, **options)
        assert on_spark.summary() == on_duckdb.summary()
        for name in ("diff_summary.json", "diff.csv", *(["d.html"] if html else [])):
            got, want = ((tmp_path / side / name).read_text() for side in ("spark", "duck"))
            assert _no_ids(got) == _no_ids(want), name
    assert on_duckdb.counts["compared"] > 0
    first = diff(b, c, exact=True).first
    assert first is not None and first.step == 6 and SCALED.rsplit(".", 1)[0] in first.name
    assert main(["diff", str(b), str(c), "--exact"]) == 1
    printed = capsys.readouterr().out
    assert main(["diff", str(b), str(c), "--exact", "--engine", "spark"]) == 1
    assert capsys.readouterr().out == printed
    assert spark.sql("SELECT 1").collect()[0][0] == 1  # the command used the active session and left it running
    assert not [t.name for t in spark.catalog.listTables() if "__diff_" in t.name]  # its views dropped
    # a key repeated across files (a resumed run): both engines pair the files in the same order
    b2 = _parquet_copy(resumed_copy(base, tmp_path / "csv_b2"), tmp_path / "b2")
    c2 = _parquet_copy(resumed_copy(scaled, tmp_path / "csv_c2"), tmp_path / "c2")
    repeated = diff(b2, c2, exact=True)
    assert diff(b2, c2, exact=True, engine="spark", spark=spark).summary() == repeated.summary()
    assert repeated.first is not None and repeated.first.step == 6
    with pytest.raises(ConfigError, match="has CSV only; convert it first"):
        diff(b, scaled, engine="spark", spark=spark)
    with pytest.raises(ConfigError, match="--engine: one of duckdb, spark, not 'polars'"):
        diff(b, c, engine="polars")


def test_a_run_folder_with_glob_and_uri_characters_reads_its_own_files(
    monitor_runs: Any, tmp_path: Path, spark: Any
) -> None:
    """Spark reads a listed path as a Hadoop glob and names files by URI: ``run[1]`` must read
    ``run[1]``'s files (not ``run1``'s) and ``file`` must be the path as DuckDB gives it."""
    mine = _parquet_copy(monitor_runs.v2, tmp_path / "it's run[1] {a} +%20")
    _parquet_copy(monitor_runs.v2, tmp_path / "run1")
    (sorted(mine.glob("rank_0/weight_grad_*.parquet"))[0]).unlink()  # the two runs now differ
    register_views(spark, mine)
    got = sorted(tuple(r) for r in spark.sql("SELECT file, count(*) FROM weight_grad GROUP BY file").collect())
    want = sorted(connect(mine).execute("SELECT file, count(*) FROM weight_grad GROUP BY file").fetchall())
    assert got == want
    assert all(str(f).startswith(str(mine)) for f, _ in got)
