"""The query layer (``trainprobe.tools.query.layer``, ``trainprobe query``, ``trainprobe convert``): real
V1 and V2 runs (two gloo ranks, a NaN injected on rank 1), the reference tool's layouts, CSV and
Parquet give the same answers."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from monitor_runs import NAN_RANK, NAN_STEP  # noqa: E402
from reference_layouts import write_reference_v1, write_reference_v2  # noqa: E402
from trainprobe.cli import main  # noqa: E402
from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.query.layer import connect, describe, first_nonfinite  # noqa: E402

KEYS = "rank, step, micro_step, vpp_stage, name, scope"


def _contents(run: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every view's rows without the provenance columns, sorted; NaN as a string (NaN != NaN)."""
    con = connect(run)
    out = {}
    for view, cols in describe(con).items():
        names = [c for c, _ in cols if c not in ("file", "file_row")]
        rows = con.execute(f'SELECT {", ".join(chr(34) + n + chr(34) for n in names)} FROM "{view}"').fetchall()
        out[view] = sorted((tuple("nan" if v != v else v for v in row) for row in rows), key=repr)
    return out


def _as_parquet(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / f"parquet_{run.name}"
    shutil.copytree(run, copy)
    convert_run(copy, remove_csv=True)
    assert not list(copy.rglob("*_step*.csv")) and not list(copy.glob("*-rank*/*_*-*.csv"))
    return copy


def test_v2_views_and_first_nan(monitor_runs: Any) -> None:
    con = connect(monitor_runs.v2)
    views = describe(con)
    assert set(views) == {"module", "weight_grad", "optimizer", "param", "cc"}
    for cols in views.values():
        names = [c for c, _ in cols]
        assert names[:6] == ["rank", "step", "micro_step", "vpp_stage", "name", "scope"]
        assert names[-2:] == ["file", "file_row"] and "norm" in names
    assert con.execute("SELECT DISTINCT rank FROM weight_grad ORDER BY 1").fetchall() == [(0,), (1,)]
    [first] = first_nonfinite(con)
    assert (first["step"], first["rank"], first["name"]) == (NAN_STEP, NAN_RANK, "fc2.bias")
    assert (first["table"], first["scope"]) == ("weight_grad", "reduced")
    assert first["file"].endswith(f"rank_{NAN_RANK}/weight_grad_step3-5.csv")


def test_v1_views_and_first_nan(monitor_runs: Any) -> None:
    con = connect(monitor_runs.v1)
    views = describe(con)
    assert {"actv", "actv_grad", "grad_reduced", "grad_unreduced", "param_origin"} <= set(views)
    names = con.execute("SELECT DISTINCT name FROM grad_reduced ORDER BY 1").fetchall()
    assert ("fc2.bias",) in names and not any(":" in n for (n,) in names)  # no chunk prefix
    [first] = first_nonfinite(con)
    assert (first["step"], first["rank"], first["name"], first["table"]) == (
        NAN_STEP,
        NAN_RANK,
        "fc2.bias",
        "grad_reduced",
    )


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_csv_and_parquet_give_the_same_answers(monitor_runs: Any, tmp_path: Path, layout: str) -> None:
    run = getattr(monitor_runs, layout)
    parquet = _as_parquet(run, tmp_path)
    assert _contents(parquet) == _contents(run)
    csv_first, parquet_first = first_nonfinite(connect(run), 5), first_nonfinite(connect(parquet), 5)
    strip = [{k: v for k, v in row.items() if k not in ("file", "value")} for row in csv_first]
    assert strip == [{k: v for k, v in row.items() if k not in ("file", "value")} for row in parquet_first]
    assert len(csv_first) >= 3 and {r["step"] for r in csv_first} == {NAN_STEP}



@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_a_parquet_run_is_answered_by_one_query(monitor_runs: Any, tmp_path: Path, layout: str) -> None:
    """A run of Parquet files only: "first NaN/inf" is one query (the first bad step nested in
    the ordered one), with the answers of the two queries on the same views and of the CSV run;
    a Parquet run without any NaN answers nothing."""
    import trainprobe.tools.query.layer as query_module

    run = getattr(monitor_runs, layout)
    parquet = _as_parquet(run, tmp_path)
    con, views, files = query_module._connect(parquet)
    assert views == {v: [c for c, _ in cols] for v, cols in describe(con).items()}
    assert {f.format for f in files} == {"parquet"}
    from trainprobe.tools.sql.questions import first_bad_step_sql, first_nonfinite_sql

    nested = first_nonfinite_sql(views, None, 5)
    assert nested.count(first_bad_step_sql(views)) == len(views)  # built from its parts, one query
    [(step,)] = con.execute(first_bad_step_sql(views)).fetchall()
    two = con.execute(first_nonfinite_sql(views, step, 5)).fetchall()
    def no_value(rows: list[Any]) -> list[Any]:
        return [r[:9] + r[10:] for r in rows]  # the value is NaN: never equal to itself

    assert no_value(con.execute(nested).fetchall()) == no_value(two) and len(two) >= 3

    def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k not in ("file", "value")} for row in rows]

    one = first_nonfinite(parquet, 5)
    assert strip(one) == strip(first_nonfinite(connect(parquet), 5)) == strip(first_nonfinite(run, 5))
    assert len(one) >= 3 and {r["step"] for r in one} == {NAN_STEP}
    clean = tmp_path / "clean"
    write_reference_v2(clean)
    convert_run(clean, remove_csv=True)
    assert first_nonfinite(clean) == []


def _earlier_trainprobe_v1(reference_run: Path, target: Path) -> None:
    """The reference V1 tree as trainprobe's earlier V1 writer wrote it: ``<vpp>:`` chunk prefixes,
    no ``shape,dtype`` columns."""
    target.mkdir(parents=True)
    for path in reference_run.glob("*.csv"):
        lines = path.read_text().splitlines()
        out = []
        for index, line in enumerate(lines):
            import csv as _csv

            cells = next(_csv.reader([line]))[:-2]
            if index:
                cells[1] = f"{cells[0]}:{cells[1]}"
            out.append(",".join(cells))
        (target / path.name).write_text("\n".join(out) + "\n")


def test_reference_and_trainprobe_v1_layouts_agree(tmp_path: Path) -> None:
    ref = write_reference_v1(tmp_path / "ref")
    ours = tmp_path / "ours" / ref.name
    _earlier_trainprobe_v1(ref, ours)
    strip = "SELECT {cols} FROM {view} ORDER BY ALL"
    con_ref, con_ours = connect(tmp_path / "ref"), connect(tmp_path / "ours")
    assert set(describe(con_ref)) == set(describe(con_ours)) == {"actv", "actv_grad", "grad_reduced", "other"}
    cols = f"{KEYS}, min, max, norm, zeros, nans, mean"
    for view in describe(con_ref):
        got = con_ours.execute(strip.format(cols=cols, view=view)).fetchall()
        want = con_ref.execute(strip.format(cols=cols, view=view)).fetchall()
        assert repr(got) == repr(want)
    shapes = con_ref.execute("SELECT DISTINCT shape, dtype FROM actv ORDER BY 1").fetchall()
    assert ("[4, 8]", "torch.float32") in shapes
    # the reference's "no gradient" rows (nan in every cell, dtype 'nan' too) are not a NaN
    assert first_nonfinite(con_ref) == []
    assert _contents(_as_parquet(tmp_path / "ref", tmp_path)) == _contents(tmp_path / "ref")


def test_reference_v2_crlf_layout(tmp_path: Path) -> None:
    write_reference_v2(tmp_path / "ref")
    con = connect(tmp_path / "ref")
    rows = con.execute("SELECT rank, step, micro_step, vpp_stage, name, scope, norm FROM weight_grad").fetchall()
    assert rows == [(0, 0, 1, -1, "fc1.weight", "reduced", 0.22), (0, 1, 1, -1, "fc1.weight", "reduced", 1.22)]
    assert con.execute("SELECT count(*), count(micro_step) FROM module").fetchall() == [(4, 0)]
    module = tmp_path / "ref" / "rank_0" / "module_step0-1.csv"
    module.write_bytes(module.read_bytes()[:-1])  # killed between "\r" and "\n": the record is whole
    assert connect(tmp_path / "ref").execute("SELECT count(*) FROM module").fetchall() == [(4,)]
    parquet = _as_parquet(tmp_path / "ref", tmp_path)
    assert _contents(parquet) == _contents(tmp_path / "ref")


def _v2_file(folder: Path, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "weight_grad_step0-1.csv"
    path.write_text(text)
    return path


HEADER = "vpp_stage,step,module_name,scope,micro_step,min,norm,nans\n"


@pytest.mark.parametrize(
    "torn",
    ["0,1,fc1.weight,reduced,,0.5,1.2", '0,1,"odd\nname'],
    ids=["cut-number", "inside-quoted-name"],
)
def test_a_torn_last_record_is_left_out(tmp_path: Path, torn: str) -> None:
    whole = '0,0,fc1.weight,reduced,,-0.5,1.0,0\n0,0,"a,b",reduced,1,-inf,2.0,0\n'
    _v2_file(tmp_path / "run" / "rank_0", HEADER + whole + torn)
    con = connect(tmp_path / "run")
    rows = con.execute("SELECT step, name, micro_step, min, norm FROM weight_grad ORDER BY file_row").fetchall()
    expected = [(0, "fc1.weight", None, -0.5, 1.0), (0, "a,b", 1, float("-inf"), 2.0)]
    assert repr(rows) == repr(expected)
    parquet = _as_parquet(tmp_path / "run", tmp_path)
    assert _contents(parquet) == _contents(tmp_path / "run")


def test_file_row_follows_files_and_lines_across_parallel_scans(tmp_path: Path) -> None:
    """30 CSV files of 3 ranks, read as several row-numbered scans (more than DuckDB's threads):
    within each file ``file_row`` follows its lines, and across the files of one view it grows in
    the order the files are listed (rank, then step window), as one scan would number them."""
    import duckdb

    for rank in range(3):
        for window in range(10):
            lines = [f"0,{2 * window + s},p{i},reduced,,{rank}.{window}{s}{i},1.0,0" for s in range(2) for i in range(3)]
            folder = tmp_path / "run" / f"rank_{rank}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"weight_grad_step{2 * window}-{2 * window + 1}.csv").write_text(HEADER + "\n".join(lines) + "\n")
    con = duckdb.connect(config={"threads": 2})
    connect(tmp_path / "run", connection=con)
    rows = con.execute("SELECT rank, step, name, min, file, file_row FROM weight_grad ORDER BY file_row").fetchall()
    assert len(rows) == 180
    listed = [(r, s, n, m) for r, s, n, m, _, _ in rows]
    assert listed == sorted(listed)  # rank, then step, then the line (p0, p1, p2): file order, line order
    files = {f for *_, f, _ in rows}
    assert len(files) == 30
    gaps = {b[-1] - a[-1] for a, b in zip(rows, rows[1:]) if a[-2] == b[-2]}
    assert gaps == {1}  # the lines of one file are numbered one after the other
    plan = con.execute("EXPLAIN SELECT sum(file_row) FROM weight_grad").fetchall()[0][1]
    assert plan.count("READ_CSV") > 2  # several scans, read side by side


def test_empty_and_header_only_files(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "rank_0"
    _v2_file(folder, HEADER + "0,3,w,reduced,,1.0,2.0,0\n")
    (folder / "weight_grad_step4-5.csv").write_text("")
    (folder / "weight_grad_step6-7.csv").write_text("vpp_stage,step,modu")
    (folder / "module_step0-1.csv").write_text("vpp_stage,step,module_name,scope,min\n")
    con = connect(tmp_path / "run")
    assert con.execute("SELECT count(*) FROM weight_grad").fetchall() == [(1,)]
    assert con.execute("SELECT count(*) FROM module").fetchall() == [(0,)]  # a header only: no rows yet


def test_a_cell_that_is_not_a_number_is_one_line_naming_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _v2_file(tmp_path / "run" / "rank_0", HEADER + "0,1,w,reduced,,abc,1.0,0\n")
    assert main(["query", str(tmp_path / "run"), "SELECT * FROM weight_grad"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and '"abc"' in err and f"(file {path})" in err
    assert "Possible solutions" not in err


def test_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no monitor data file"):
        connect(tmp_path)
    _v2_file(tmp_path / "run" / "rank_0", "vpp_stage,step,scope,min\n0,1,x,2\n")
    with pytest.raises(ConfigError, match=r"weight_grad_step0-1\.csv: header .* lacks \['module_name'\]"):
        connect(tmp_path / "run")


def test_cli_query_schema_csv_json(monitor_runs: Any, capsys: pytest.CaptureFixture[str]) -> None:
    run = str(monitor_runs.v2)
    sql = "SELECT step, count(*) AS n FROM weight_grad WHERE rank = 0 GROUP BY step ORDER BY step LIMIT 2"
    assert main(["query", run, sql, "--csv"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "step,n"
    assert main(["query", run, sql, "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0])["step"] == 0
    assert main(["query", run, "--schema"]) == 0
    assert any(line.split() == ["weight_grad", "norm", "DOUBLE"] for line in capsys.readouterr().out.splitlines())
    assert main(["query", run, "--first-nonfinite", "--json"]) == 0
    first = json.loads(capsys.readouterr().out)
    assert (first["step"], first["rank"], first["name"], first["value"]) == (NAN_STEP, NAN_RANK, "fc2.bias", "nan")
    assert main(["query", run, "SELECT nope FROM weight_grad"]) == 2
    assert "trainprobe query: error:" in capsys.readouterr().err


def test_without_duckdb_the_tool_says_how_to_install(
    monitor_runs: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "duckdb", None)
    assert main(["query", str(monitor_runs.v2), "--schema"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("pip install 'trainprobe[query]'") and len(err.splitlines()) == 1


def test_help_loads_neither_duckdb_nor_pyarrow() -> None:
    code = (
        "import sys\nfrom trainprobe.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('duckdb', 'pyarrow', 'pyspark', 'sqlglot') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_connection_works_with_arrow_and_pandas(monitor_runs: Any) -> None:
    con = connect(monitor_runs.v2)
    answer = con.sql("SELECT rank, step, norm FROM param").arrow()
    table = answer.read_all() if hasattr(answer, "read_all") else answer  # DuckDB 2 gives a batch reader
    assert table.num_rows > 0 and table.column_names == ["rank", "step", "norm"]
    pd = pytest.importorskip("pandas")
    frame = con.sql("SELECT step, max(norm) AS top FROM param GROUP BY step ORDER BY step").df()
    assert isinstance(frame, pd.DataFrame) and list(frame["step"]) == list(range(6))


def test_cli_convert(monitor_runs: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "v1"
    shutil.copytree(monitor_runs.v1, run)
    csv_count = len(list(run.glob("*-rank*/*.csv")))
    assert main(["convert", str(run), "--to", "parquet"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"converted {csv_count} CSV file(s) to Parquet")
    assert len([line for line in out if line.startswith("wrote ")]) == csv_count  # every file it wrote, named
    assert len(list(run.glob("*-rank*/*.parquet"))) == csv_count
    assert not list(run.rglob(".*.partial"))
    assert _contents(run) == _contents(monitor_runs.v1)  # the Parquet files are read, not the CSV ones
    assert main(["convert", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
