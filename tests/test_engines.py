"""The engines' one interface (:mod:`trainprobe.tools.engines.base`): every public method of each
engine class is called here on real runs of the tiny GPT, and each one works (no subclass that
skips its parent's state, no method left unexercised: a new public method fails
:func:`_all_called` until this file calls it)."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")

from diff_runs import train  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.engines.base import MAIN, Engine, Rows  # noqa: E402
from trainprobe.tools.engines.duckdb_engine import DuckEngine, LocalRows, Staging  # noqa: E402
from trainprobe.tools.engines.spark_engine import SparkEngine  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("engines")
    return train(base / "a", steps=8), train(base / "b", steps=8, seed=1)


def _public(cls: type) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def _all_called(cls: type, called: set[str]) -> None:
    assert _public(cls) - called == set(), f"{cls.__name__}: public methods this test does not call"


def _steps(engine: Any, table: str, local: bool = False) -> list[int]:
    fetch = engine.fetch_local if local else engine.fetch
    return [s for (s,) in fetch(f"SELECT DISTINCT step FROM {table} ORDER BY 1")]


def test_every_method_of_the_duckdb_engine_works(runs: tuple[Path, Path], tmp_path: Path) -> None:
    a, b = runs
    called: set[str] = set()
    engine: Engine = DuckEngine(a, spill=True)
    assert isinstance(engine, DuckEngine)
    views = engine.views()
    called |= {"views", "full"}
    assert {"module", "weight_grad", "optimizer", "param"} <= set(views) and not engine.full
    assert views["weight_grad"][:6] == ["rank", "step", "micro_step", "vpp_stage", "name", "scope"]
    assert engine.ref(MAIN, "weight_grad") == '"weight_grad"'
    [(rows,)] = engine.fetch(f"SELECT count(*) FROM {engine.ref(MAIN, 'weight_grad')}")
    called |= {"ref", "fetch"}
    assert rows > 0
    engine.narrow(0, 0)  # windows of 4 steps: the views hold steps 0-3 only
    assert _steps(engine, "weight_grad") == [0, 1, 2, 3]
    engine.narrow(0, 7)
    assert _steps(engine, "weight_grad") == list(range(8))
    called.add("narrow")
    [record] = engine.records("SELECT step, norm FROM weight_grad WHERE step = 1 ORDER BY file_row LIMIT 1")
    assert set(record) == {"step", "norm"} and record["step"] == 1 and record["norm"] > 0
    arrays = engine.arrays("SELECT step FROM weight_grad WHERE step < 2")
    assert set(arrays["step"].tolist()) == {0, 1}
    assert engine.columns("SELECT step, name AS n FROM weight_grad") == ["step", "n"]
    called |= {"records", "arrays", "columns"}
    engine.keep("kept_steps", "SELECT DISTINCT step FROM weight_grad")
    engine.keep_rows("made", [("name", "VARCHAR"), ("n", "BIGINT"), ("x", "DOUBLE")], [("w", 1, 0.5)])
    engine.view("late", "SELECT max(step) AS s FROM kept_steps")
    assert engine.fetch("SELECT * FROM made") == [("w", 1, 0.5)] and engine.fetch("SELECT s FROM late") == [(7,)]
    called |= {"keep", "keep_rows", "view"}
    assert engine.layout() == [] and engine.merged(MAIN) == []
    called |= {"layout", "merged"}
    assert engine.ranks() == [0] and engine.rank_local_entries() == []  # one rank, no layout file
    called |= {"ranks", "rank_local_entries"}
    engine.seal()
    called.add("seal")
    with pytest.raises(Exception, match="disabled by configuration"):
        engine.fetch("SELECT * FROM read_csv('/etc/passwd')")
    out = tmp_path / "rows.csv"
    engine.write_csv("SELECT step, count(*) AS n FROM weight_grad GROUP BY step ORDER BY step", out)
    called.add("write_csv")
    with out.open() as f:
        written = list(csv.reader(f))
    assert written[0] == ["step", "n"] and [r[0] for r in written[1:]] == [str(s) for s in range(8)]
    assert _steps(engine, "weight_grad", local=True) == list(range(8))  # no staging: the views themselves
    called.add("fetch_local")
    local: Rows = engine.local()
    assert isinstance(local, LocalRows) and local.fetch("SELECT count(*) FROM weight_grad") == [(rows,)]
    called.add("local")
    engine.release()
    called.add("release")
    with pytest.raises(Exception, match="(?i)closed"):
        engine.fetch("SELECT 1")

    staged = DuckEngine(a, staging=Staging(full=False, exempt=lambda v: "step = 0" if v == "weight_grad" else None))
    assert _steps(staged, "weight_grad", local=True) == list(range(1, 8))  # the exempt rows left out
    assert staged.arrays_local("SELECT min(step) AS s FROM weight_grad")["s"].tolist() == [1]
    staged.keep_local("local_steps", "SELECT DISTINCT step FROM weight_grad")
    assert staged.fetch("SELECT min(step) FROM local_steps") == [(1,)]
    called |= {"arrays_local", "keep_local"}
    rows_of = staged.local()
    rows_of.keep("spiky", "SELECT DISTINCT step FROM weight_grad WHERE step > 5")
    rows_of.keep_rows("made", [("s", "BIGINT")], [(3,)])
    assert rows_of.arrays("SELECT step FROM spiky ORDER BY step")["step"].tolist() == [6, 7]
    assert rows_of.fetch("SELECT s FROM made") == [(3,)]
    staged.narrow(5, 5)
    assert _steps(staged, "weight_grad", local=True) == [4, 5, 6, 7]
    staged.release()

    pair = DuckEngine(merge_shards=True, insertion_order=False)
    seen = pair.attach("b", a, steps=(0, 3))
    called.add("attach")
    assert pair.attach("c", b) == pair.views("c") and set(seen) == set(pair.views("b"))
    with pytest.raises(ConfigError, match="attached already"):
        pair.attach("b", a)
    assert pair.ref("c", "param") == 'c."param"' and pair.views() == {}
    pair.seal()
    both = f"SELECT count(*) FROM {pair.ref('b', 'param')} JOIN {pair.ref('c', 'param')} USING (step, name, scope)"
    assert pair.fetch(both)[0][0] > 0
    with pytest.raises(ConfigError, match="spill=True"):
        pair.write_csv("SELECT 1", tmp_path / "x.csv")
    pair.release()
    _all_called(DuckEngine, called)
    _all_called(LocalRows, {"fetch", "arrays", "keep", "keep_rows"})


def test_a_connection_passed_in_stays_open(runs: tuple[Path, Path]) -> None:
    import duckdb

    con = duckdb.connect()
    engine = DuckEngine(runs[0], con=con)
    engine.release()
    assert con.execute("SELECT count(*) > 0 FROM weight_grad").fetchall() == [(True,)]


def test_every_method_of_the_spark_engine_works(runs: tuple[Path, Path], tmp_path: Path) -> None:
    pytest.importorskip("pyspark")
    pytest.importorskip("sqlglot")
    if shutil.which("java") is None:
        pytest.skip("Spark needs Java 17 or later")
    from trainprobe.tools.engines.spark import spark_session
    from trainprobe.tools.engines.spark_engine import on_spark
    from trainprobe.tools.query.convert import convert_run

    a = tmp_path / "a"
    shutil.copytree(runs[0], a)
    convert_run(a, remove_csv=True)
    called: set[str] = set()
    session = spark_session()
    with on_spark(session, "Spark failed") as engine:
        views = engine.attach(MAIN, a)
        side = engine.attach("b", a)
        called |= {"attach", "views", "full", "ref"}
        assert views == engine.views() == side == engine.views("b") and not engine.full
        assert engine.ref("b", "param") == '"__diff_b_param"'
        engine.narrow(0, 0)
        engine.seal()
        called |= {"narrow", "seal"}
        [(rows,)] = engine.fetch(f"SELECT count(*) FROM {engine.ref('b', 'weight_grad')}")
        assert engine.fetch_local("SELECT count(*) FROM weight_grad") == [(rows,)] and rows > 0
        assert engine.records("SELECT max(step) AS s FROM weight_grad") == [{"s": 7}]
        assert sorted(set(engine.arrays("SELECT step FROM weight_grad")["step"].tolist())) == list(range(8))
        assert engine.columns("SELECT step, name AS n FROM weight_grad") == ["step", "n"]
        called |= {"fetch", "fetch_local", "records", "arrays", "columns"}
        engine.keep("kept_steps", "SELECT DISTINCT step FROM weight_grad")
        engine.keep_rows("made", [("name", "VARCHAR"), ("n", "BIGINT")], [("w", 1)])
        engine.view("late", "SELECT max(step) AS s FROM kept_steps")
        assert engine.fetch("SELECT s FROM late") == [(7,)] and engine.fetch("SELECT * FROM made") == [("w", 1)]
        assert engine.local() is engine and engine.layout() == [] and engine.merged("b") == []
        called |= {"keep", "keep_rows", "view", "local", "layout", "merged"}
        out = tmp_path / "rows.csv"
        engine.write_csv("SELECT DISTINCT step FROM weight_grad ORDER BY step", out)
        assert out.read_text().split() == ["step", *map(str, range(8))]
        called.add("write_csv")
    called.add("release")  # on_spark released it: its views are gone from the session
    names = {t.name for t in session.catalog.listTables()}
    session.stop()
    assert not names & {"weight_grad", "__diff_b_weight_grad", "kept_steps", "made", "late"}
    _all_called(SparkEngine, called)
