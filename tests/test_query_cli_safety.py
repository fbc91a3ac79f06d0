"""``trainprobe query`` (issue #33): answers streamed with bounded memory, ``-o FILE`` written by
Python and atomically, options anywhere on the line, every DuckDB/pyarrow error one line with
exit status 2, and names printed with control characters escaped."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

import trainprobe.tools.query.cli as query_cli  # noqa: E402
from trainprobe.cli import BROKEN_PIPE, build_parser, main  # noqa: E402
from trainprobe.tools.query.layer import connect  # noqa: E402

HEADER = ["vpp_stage", "step", "module_name", "scope", "micro_step", "min", "norm", "nans"]
EVIL = "layer\x1b[2J\x1b[H\rno anomaly\x07\x85\u2028end"


def _csv_run(root: Path, names: list[str], steps: int = 2) -> Path:
    """A V2 CSV run of one rank, one ``weight_grad`` file, a row per step and name."""
    folder = root / "rank_0"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / f"weight_grad_step0-{steps - 1}.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(HEADER)
        for step in range(steps):
            for i, name in enumerate(names):
                writer.writerow([0, step, name, "reduced", "", -0.5 * i, float(i) + step, 0])
    return root


def _parquet_run(root: Path, ranks: int, steps: int, params: int) -> Path:
    """A V2 Parquet run, ``ranks * steps * params`` rows, one file per rank (pyarrow, no loop per row)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = steps * params
    names = pa.array([f"layers.{i // 4}.{'qkvo'[i % 4]}_proj.weight" for i in range(params)] * steps)
    for rank in range(ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True, exist_ok=True)
        values = np.arange(n, dtype=np.float64) * 1e-3 + rank
        table = pa.table({
            "vpp_stage": pa.array(np.zeros(n, dtype=np.int64)),
            "step": pa.array(np.repeat(np.arange(steps, dtype=np.int64), params)),
            "module_name": names,
            "scope": pa.array(["reduced"] * n).dictionary_encode(),
            "micro_step": pa.nulls(n, pa.int64()),
            "min": pa.array(-values),
            "norm": pa.array(values),
            "nans": pa.array(np.zeros(n)),
        })
        pq.write_table(table, folder / f"weight_grad_step0-{steps - 1}.parquet")
    return root


def _named_run(root: Path, names: list[str]) -> Path:
    """A V2 Parquet run of one step, a row per name (Parquet: any text survives in a name)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "rank_0"
    folder.mkdir(parents=True, exist_ok=True)
    n = len(names)
    table = pa.table({
        "vpp_stage": pa.array([0] * n, pa.int64()), "step": pa.array([0] * n, pa.int64()),
        "module_name": pa.array(names), "scope": pa.array(["reduced"] * n),
        "min": pa.array([0.0] * n), "norm": pa.array([float(i) for i in range(n)]),
    })
    pq.write_table(table, folder / "weight_grad_step0-0.parquet")
    return root


def _trainprobe(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", *args], capture_output=True, text=True, timeout=timeout
    )


# -- 1. streaming -------------------------------------------------------------------------------


HEAD_2 = r"""
import json, os, subprocess, sys, time
start = time.perf_counter()
child = subprocess.Popen(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
lines = [child.stdout.readline().decode(), child.stdout.readline().decode()]
running = child.poll() is None
child.stdout.close()  # as `head -2` does
_, status, usage = os.wait4(child.pid, 0)
print(json.dumps({"lines": lines, "running": running, "status": os.waitstatus_to_exitcode(status),
                  "rss_mb": usage.ru_maxrss / 1024, "err": child.stderr.read().decode(),
                  "seconds": time.perf_counter() - start}))
"""
"""``cmd | head -2`` measured: run by a small Python of its own, so that the peak RSS read from
``wait4`` is the command's (Linux keeps a forked child's high-water mark across ``exec``: forked
from pytest, which holds torch, it would start at pytest's RSS)."""


def test_two_million_rows_into_head_stay_under_250_mb(tmp_path: Path) -> None:
    """``trainprobe query RUN "SELECT * FROM weight_grad" | head -2`` over 2 M rows: the first lines
    come while the query still runs, the process's peak RSS stays at most 250 MB (building the
    whole answer took 2.8 GB), and the closed pipe ends it quietly (status 141, nothing on stderr)."""
    run = _parquet_run(tmp_path / "run", ranks=4, steps=500, params=1000)
    command = [sys.executable, "-m", "trainprobe", "query", str(run), "SELECT * FROM weight_grad"]
    done = subprocess.run([sys.executable, "-c", HEAD_2, *command], capture_output=True, text=True, timeout=300)
    got = json.loads(done.stdout)
    print(f"2 M rows | head -2: {got['seconds']:.2f} s, peak RSS {got['rss_mb']:.0f} MB")
    first, second = got["lines"]
    assert first.split()[:6] == ["rank", "step", "micro_step", "vpp_stage", "name", "scope"]
    assert set(second.strip().replace(" ", "")) == {"-"}
    assert got["running"]  # 2 M rows take seconds to print: the header came before the end
    assert (got["status"], got["err"]) == (BROKEN_PIPE, "")
    assert got["rss_mb"] <= 250


def test_table_widths_come_from_the_first_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _csv_run(tmp_path / "run", ["a", "bb", "a_much_longer_name"], steps=1)
    monkeypatch.setattr(query_cli, "BATCH_ROWS", 2)
    assert main(["query", str(run), "SELECT name, norm FROM weight_grad ORDER BY file_row"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "name  norm",
        "----  ----",
        "a     0.0",
        "bb    1.0",
        "a_much_longer_name  2.0",  # wider than the first batch: only its own line widens
        "(3 rows)",
    ]


def test_csv_and_json_stream_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    run = _csv_run(tmp_path / "run", [f"p{i}" for i in range(7)], steps=3)
    monkeypatch.setattr(query_cli, "BATCH_ROWS", 4)
    sql = "SELECT step, name, norm, micro_step FROM weight_grad ORDER BY step, name"
    want = connect(run).execute(sql).fetchall()
    assert main(["query", str(run), sql, "--csv"]) == 0
    rows = list(csv.reader(io.StringIO(capsys.readouterr().out)))
    assert rows[0] == ["step", "name", "norm", "micro_step"] and len(rows) == 22
    assert rows[1:] == [[str(s), n, repr(v), "NULL"] for s, n, v, _ in want]
    assert main(["query", str(run), sql, "--json"]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert got == [{"step": s, "name": n, "norm": v, "micro_step": None} for s, n, v, _ in want]


# -- 2. -o FILE ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["out.csv", "out.json", "out.jsonl", "out.parquet"])
def test_output_file_in_the_format_of_its_suffix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    run = _csv_run(tmp_path / "run", ["w", "b,c", "x\ny"], steps=2)
    target = tmp_path / "answers" / name  # the folder is created
    sql = "SELECT step, name, norm, micro_step FROM weight_grad ORDER BY step, file_row"
    want = connect(run).execute(sql).fetchall()
    assert main(["query", str(run), sql, "-o", str(target)]) == 0
    kind = {".csv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}[target.suffix]
    assert capsys.readouterr().out == f"wrote 6 rows ({kind}) to {target}\n"
    if kind == "csv":
        rows = list(csv.reader(io.StringIO(target.read_text(encoding="utf-8"))))
        assert rows[1:] == [[str(s), n, repr(v), "NULL"] for s, n, v, _ in want]  # "x\ny" kept as it is
    elif kind == "json":
        got = [json.loads(line) for line in target.read_text(encoding="utf-8").splitlines()]
        assert [tuple(g.values()) for g in got] == want
    else:
        import pyarrow.parquet as pq

        table = pq.read_table(target)
        assert table.column_names == ["step", "name", "norm", "micro_step"]
        assert [tuple(r.values()) for r in table.to_pylist()] == want
    assert sorted(p.name for p in target.parent.iterdir()) == [name]  # no temporary file left


def test_parquet_output_streams_large_answers_in_row_groups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.parquet as pq

    run = _parquet_run(tmp_path / "run", ranks=2, steps=100, params=1000)
    target = tmp_path / "all.parquet"
    assert main(["query", str(run), "SELECT * FROM weight_grad", "--parquet", "-o", str(target)]) == 0
    assert capsys.readouterr().out == f"wrote 200000 rows (parquet) to {target}\n"
    meta = pq.ParquetFile(target).metadata
    assert meta.num_rows == 200_000 and meta.num_row_groups >= 200_000 // query_cli.PARQUET_BATCH_ROWS
    empty = tmp_path / "none.parquet"
    assert main(["query", str(run), "SELECT step, norm FROM weight_grad WHERE false", "-o", str(empty)]) == 0
    assert pq.read_table(empty).column_names == ["step", "norm"] and pq.read_table(empty).num_rows == 0


def test_schema_and_first_nonfinite_to_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import pyarrow.parquet as pq

    run = _csv_run(tmp_path / "run", ["w"], steps=2)
    assert main(["query", str(run), "--schema", "-o", str(tmp_path / "schema.parquet")]) == 0
    assert pq.read_table(tmp_path / "schema.parquet").column_names == ["view", "column", "type"]
    assert main(["query", str(run), "--first-nonfinite", "-o", str(tmp_path / "first.jsonl")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote 0 rows (json) to {tmp_path / 'first.jsonl'}"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-o", "x.txt"], "say the format with --csv, --json or --parquet"),
        (["--csv", "-o", "x.parquet"], "the name says parquet but --csv was given"),
        (["--parquet"], "--parquet: give the file to write with -o FILE"),
        (["-o", "."], "is a folder"),
        (["-o", "rank_0/weight_grad_step0-1.csv", "--csv"], "a monitor data file's name in the run"),
        (["-o", "rank_0/weight_grad_step0-1.parquet"], "a monitor data file's name in the run"),
        (["-o", "a\0b.csv"], "NUL byte"),
    ],
)
def test_output_mistakes_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], message: str
) -> None:
    run = _csv_run(tmp_path / "run", ["w"], steps=2)
    monkeypatch.chdir(run)
    data = (run / "rank_0" / "weight_grad_step0-1.csv").read_bytes()
    assert main(["query", str(run), "SELECT * FROM weight_grad", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.splitlines()) == 1
    assert (run / "rank_0" / "weight_grad_step0-1.csv").read_bytes() == data


def test_a_failed_query_leaves_the_output_file_as_it_was(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _csv_run(tmp_path / "run", [f"p{i}" for i in range(3000)], steps=1)
    path = run / "rank_0" / "weight_grad_step0-0.csv"
    lines = path.read_text().splitlines()
    lines[2500] = "0,0,bad,reduced,,abc,1.0,0"  # a cell that is not a number, after the first batches
    path.write_text("\n".join(lines) + "\n")
    for name in ("old.csv", "old.parquet"):
        target = tmp_path / "out" / name
        target.parent.mkdir(exist_ok=True)
        target.write_text("the earlier answer")
        assert main(["query", str(run), "SELECT * FROM weight_grad", "-o", str(target)]) == 2
        err = capsys.readouterr().err
        assert '"abc"' in err and len(err.splitlines()) == 1
        assert target.read_text() == "the earlier answer"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["old.csv", "old.parquet"]


# -- 3. options anywhere --------------------------------------------------------------------------


def test_options_before_the_sql_parse() -> None:
    parser = build_parser()
    args = parser.parse_args(["query", "RUN", "--engine", "spark", "SELECT 1"])
    assert (args.run, args.sql, args.engine) == ("RUN", "SELECT 1", "spark")
    args = parser.parse_args(["query", "--csv", "-o", "x.csv", "RUN", "SELECT 1"])
    assert (args.run, args.sql, args.csv, args.output) == ("RUN", "SELECT 1", True, "x.csv")
    args = parser.parse_args(["query", "RUN", "--", "-- a comment\nSELECT 1"])
    assert args.sql == "-- a comment\nSELECT 1"


def test_options_anywhere_on_the_command_line(tmp_path: Path) -> None:
    run = str(_csv_run(tmp_path / "run", ["w"], steps=2))
    sql = "SELECT step FROM weight_grad ORDER BY step"
    for line in (["--csv", run, sql], [run, "--engine", "duckdb", "--csv", sql], [run, sql, "--csv"]):
        done = _trainprobe("query", *line)
        assert (done.returncode, done.stdout, done.stderr) == (0, "step\n0\n1\n", ""), line
    done = _trainprobe("query", run, sql, "extra")
    assert done.returncode == 2 and "unrecognized arguments: extra" in done.stderr


# -- 4. errors: one line, exit 2, no traceback ----------------------------------------------------


def _broken_runs(root: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = _parquet_run(root / "good", ranks=1, steps=20, params=100)
    truncated = root / "truncated" / "rank_0"
    truncated.mkdir(parents=True)
    data = (good / "rank_0" / "weight_grad_step0-19.parquet").read_bytes()
    (truncated / "weight_grad_step0-19.parquet").write_bytes(data[: len(data) // 2])
    foreign = root / "foreign" / "rank_0"
    foreign.mkdir(parents=True)
    pq.write_table(pa.table({"a": [1, 2], "b": ["x", "y"]}), foreign / "weight_grad_step0-9.parquet")
    return {"good": good, "truncated": truncated.parent, "foreign": foreign.parent}


ERROR_CASES = [
    ("truncated", ["SELECT * FROM weight_grad"], "weight_grad_step0-19.parquet"),
    ("truncated", ["--first-nonfinite"], "weight_grad_step0-19.parquet"),
    ("truncated", ["--schema", "-o", "{tmp}/s.parquet"], "weight_grad_step0-19.parquet"),
    ("foreign", ["SELECT * FROM weight_grad"], "weight_grad_step0-9.parquet"),
    ("foreign", ["SELECT * FROM weight_grad", "-o", "{tmp}/f.parquet"], "weight_grad_step0-9.parquet"),
    ("good", ["SELEC * FROM weight_grad"], "syntax error"),
    ("good", ["SELECT * FROM weight_grad LIMIT 99999999999999999999999999999999"], "out of range"),
    ("good", ["SELECT * FROM weight_grad OFFSET 99999999999999999999999999999999", "-o", "{tmp}/o.parquet"],
     "out of range"),
    ("good", ["SELECT 99999999999999999999999999999999999999999999::BIGINT", "--json"], "out of range"),
    ("good", ["SELECT * FROM read_csv('/etc/passwd')"], "the SQL failed"),
    ("good", ["COPY weight_grad TO '{tmp}/stolen.csv'"], "the SQL failed"),
]


def test_errors_are_one_line_without_a_traceback(tmp_path: Path) -> None:
    runs = _broken_runs(tmp_path / "runs")
    for run, args, expected in ERROR_CASES:
        line = [a.format(tmp=tmp_path) for a in args]
        done = _trainprobe("query", str(runs[run]), *line)
        assert done.returncode == 2, (run, line, done.stderr)
        assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, (run, line, done.stderr)
        assert done.stderr.startswith("trainprobe query: error: ") and expected in done.stderr, (run, line)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # nothing written: not -o, not COPY


# -- 5. control characters ------------------------------------------------------------------------


def test_names_printed_as_a_table_cannot_rewrite_the_terminal(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _named_run(tmp_path / "run", [EVIL, "plain"])
    sql = 'SELECT name AS "col\x1b[31m", norm FROM weight_grad ORDER BY file_row'
    assert main(["query", str(run), sql]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\r\x07\x85\u2028")
    lines = out.splitlines()
    assert lines[0].startswith("col\\x1b[31m")
    assert lines[2] == "layer\\x1b[2J\\x1b[H\\rno anomaly\\x07\\x85\\u2028end  0.0"
    assert lines[3].startswith("plain ") and lines[-1] == "(2 rows)"


def test_csv_and_json_keep_the_data_and_escape_for_terminals(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = _named_run(tmp_path / "run", [EVIL])
    sql = "SELECT name FROM weight_grad"
    assert main(["query", str(run), sql, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "\x1b" not in out and json.loads(out)["name"] == EVIL
    assert main(["query", str(run), sql, "--csv"]) == 0  # a pipe (captured): the exact text
    assert list(csv.reader(io.StringIO(capsys.readouterr().out, newline="")))[1] == [EVIL]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    with query_cli.open_answer(run, sql) as answer:
        terminal = Terminal()
        assert query_cli.print_answer(answer, "csv", terminal) == 1
    assert terminal.getvalue().splitlines()[1] == "layer\\x1b[2J\\x1b[H\\rno anomaly\\x07\\x85\\u2028end"
    target = tmp_path / "names.csv"
    assert main(["query", str(run), sql, "-o", str(target)]) == 0
    assert list(csv.reader(io.StringIO(target.read_bytes().decode("utf-8"), newline="")))[1] == [EVIL]
