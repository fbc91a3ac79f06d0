"""The summary in the footer of every Parquet file trainprobe writes (sink, ``convert``): true of
the file's rows (the query layer's non-finite rule, row count, columns), read without a Parquet
library; "first NaN/inf" of a Parquet run answered from it gives the row path's answer, and a
file whose summary no longer holds is read row by row."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("duckdb")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from models import MLP  # noqa: E402
from reference_layouts import write_reference_v1  # noqa: E402
from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.engine.sinks.parquet_summary import SUMMARY_KEY, decode, read_summary  # noqa: E402
from trainprobe.tools.query import layer as query  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.query.layer import connect, first_nonfinite, literal  # noqa: E402
from trainprobe.tools.runs.files import find_run_files  # noqa: E402
from trainprobe.tools.sql.questions import TEXT_COLUMNS, bad_rows_sql  # noqa: E402

OPS = ["min", "max", "mean", "norm", "nans"]


def _train(out: Path, bad_at: int, bad: float) -> Path:
    """A real V2 run written as Parquet; one gradient made ``bad`` at step ``bad_at``."""
    config = {
        "output_dir": str(out),
        "format": "parquet",
        "step_count_per_record": 3,
        "monitors": {name: {"enabled": True, "ops": OPS} for name in ("module", "weight_grad", "optimizer", "param")},
    }
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMonitorV2(config)
    mon.start(model=model, optimizer=opt)
    for step in range(8):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if step == bad_at:
            model.fc1.weight.grad[0, 0] = bad
        opt.step()
        opt.zero_grad()
    mon.stop()
    return out


def _true_summary(path: Path) -> tuple[int | None, int, tuple[str, ...]]:
    """The first non-finite step (by the query layer's SQL), row count and columns of ``path``."""
    import duckdb

    con = duckdb.connect()
    columns = tuple(str(r[0]) for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({literal(str(path))})").fetchall())
    ops = [c for c in columns if c not in ("vpp_stage", "step", "micro_step", "name", "module_name", "scope", *TEXT_COLUMNS)]
    bad = bad_rows_sql(["step", *ops, *(t for t in TEXT_COLUMNS if t in columns)])
    [(first, rows)] = con.execute(
        f"SELECT min(step) FILTER (WHERE {bad}), count(*) FROM read_parquet({literal(str(path))})"
    ).fetchall()
    return first, rows, columns


def _strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: ("nan" if v != v else v) for k, v in row.items()} for row in rows]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_the_sinks_summaries_are_true_and_answer_first_nan(tmp_path: Path, bad: float) -> None:
    run = _train(tmp_path / "run", bad_at=4, bad=bad)
    files = find_run_files(run)
    assert files and all(f.format == "parquet" for f in files)
    for f in files:
        summary = read_summary(f.path)
        assert summary is not None, f.path
        assert (summary.first_bad_step, summary.rows, summary.columns) == _true_summary(f.path)
        [value] = [v for k, v in (pq.read_metadata(str(f.path)).metadata or {}).items() if k == SUMMARY_KEY.encode()]
        assert decode(value) == summary  # the entry a Parquet library reads is the one read here
    assert {read_summary(f.path).first_bad_step for f in files} >= {None, 4}  # type: ignore[union-attr]
    answer = first_nonfinite(run, 5)
    assert answer and answer[0]["step"] == 4 and answer[0]["name"] == "fc1.weight"
    assert _strip(answer) == _strip(first_nonfinite(connect(run), 5))  # the row path, on every file


def test_convert_writes_true_summaries_also_for_reference_v1_no_tensor_rows(tmp_path: Path) -> None:
    """The reference V1 layout's ``dtype`` 'nan' rows (no tensor) are not non-finite, in the
    summary as in the SQL."""
    run = write_reference_v1(tmp_path / "ref", steps=3)
    grad = run / "grad_reduced_0-2.csv"
    grad.write_text(grad.read_text() + "0,extra.weight,1,inf,1.0,1.0,0.0,0,1.0,[2],torch.float32\n")
    csv_answer = first_nonfinite(run, 5)
    assert [(r["step"], r["name"]) for r in csv_answer] == [(1, "extra.weight")]
    convert_run(run, remove_csv=True)
    for f in find_run_files(run):
        summary = read_summary(f.path)
        assert summary is not None and (summary.first_bad_step, summary.rows, summary.columns) == _true_summary(f.path)
    strip = [{k: v for k, v in r.items() if k not in ("file", "value")} for r in csv_answer]
    assert [{k: v for k, v in r.items() if k not in ("file", "value")} for r in first_nonfinite(run, 5)] == strip
    summaries = {f.path.name: read_summary(f.path) for f in find_run_files(run)}
    assert summaries["actv_grad_0-2.parquet"].first_bad_step is None  # type: ignore[union-attr]
    assert summaries["grad_reduced_0-2.parquet"].first_bad_step == 1  # type: ignore[union-attr]


def test_a_run_without_a_non_finite_value_is_answered_from_the_footers_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _train(tmp_path / "run", bad_at=-1, bad=0.0)
    monkeypatch.setattr(query, "_connect", lambda *a, **k: pytest.fail("rows were read"))
    assert first_nonfinite(run) == []


def test_a_file_changed_since_its_summary_is_read_row_by_row(tmp_path: Path) -> None:
    """The file holding the first NaN loses that step's rows, rewritten by a tool that copies
    the footer's entries: its summary's row count no longer holds, and the answer is the row
    path's (over every file)."""
    run = _train(tmp_path / "run", bad_at=4, bad=float("nan"))
    path = run / "rank_0" / "weight_grad_step3-5.parquet"
    entries = pq.read_metadata(str(path)).metadata
    assert SUMMARY_KEY.encode() in entries
    table = pq.read_table(str(path))
    kept = table.filter(pa.compute.not_equal(table.column("step"), 4))
    pq.write_table(kept.replace_schema_metadata({SUMMARY_KEY: entries[SUMMARY_KEY.encode()]}), str(path))
    assert SUMMARY_KEY.encode() in pq.read_metadata(str(path)).metadata
    assert read_summary(path) is None
    before = first_nonfinite(connect(run), 50)
    assert before and all(r["file"] != str(path) or r["step"] != 4 for r in before)
    assert _strip(first_nonfinite(run, 50)) == _strip(before)


@pytest.mark.parametrize(
    "content", [b"", b"PAR1", b"not parquet at all, just text\n", b"PAR1" + b"\xff" * 40 + b"\x10\x00\x00\x00PAR1"]
)
def test_a_damaged_or_foreign_file_has_no_summary(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "weight_grad_step0-2.parquet"
    path.write_bytes(content)
    assert read_summary(path) is None


def test_a_parquet_file_from_another_writer_has_no_summary_and_is_read(tmp_path: Path) -> None:
    run = _train(tmp_path / "run", bad_at=4, bad=float("inf"))
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    for f in find_run_files(copy):
        table = pq.read_table(str(f.path))
        pq.write_table(table.replace_schema_metadata({}), str(f.path))
        assert read_summary(f.path) is None
    assert _strip(first_nonfinite(copy, 3)) == _strip(
        [{**r, "file": r["file"].replace(str(run), str(copy))} for r in first_nonfinite(run, 3)]
    )


def test_a_file_whose_columns_differ_from_its_summary_is_read_row_by_row(tmp_path: Path) -> None:
    """Same rows, a column dropped, the footer entry copied: the summary's columns do not hold,
    and the answer is the row path's."""
    run = _train(tmp_path / "run", bad_at=4, bad=float("inf"))
    path = run / "rank_0" / "weight_grad_step3-5.parquet"
    entries = pq.read_metadata(str(path)).metadata
    table = pq.read_table(str(path)).drop_columns(["mean"])
    pq.write_table(table.replace_schema_metadata({SUMMARY_KEY: entries[SUMMARY_KEY.encode()]}), str(path))
    assert read_summary(path) is not None  # the row count still matches
    assert _strip(first_nonfinite(run, 5)) == _strip(first_nonfinite(connect(run), 5))


def test_monitor_v1_parquet_summaries_are_true(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Monitor V1's Parquet files (``shape``/``dtype`` columns, every table) carry true summaries."""
    import json

    from trainprobe.frontdoors.monitor_v1 import TrainerMon

    out = tmp_path / "v1"
    monkeypatch.setenv("MONITOR_OUTPUT_DIR", str(out))
    config = {"targets": {}, "all_xy": True, "wg_distribution": True, "mv_distribution": True,
              "param_distribution": True, "ops": OPS, "format": "parquet", "step_count_per_record": 3}
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(config))
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mon = TrainerMon(str(path), params_have_main_grad=False)
    mon.set_monitor(model, grad_acc_steps=1, optimizer=opt)
    for step in range(6):
        torch.manual_seed(step)
        model(torch.randn(4, 6)).pow(2).mean().backward()
        if step == 4:
            model.fc1.weight.grad[0, 0] = float("nan")
        opt.step()
        opt.zero_grad()
    mon.stop()
    files = find_run_files(out)
    assert len(files) > 3
    for f in files:
        summary = read_summary(f.path)
        assert summary is not None and (summary.first_bad_step, summary.rows, summary.columns) == _true_summary(f.path)
    assert _strip(first_nonfinite(out, 5)) == _strip(first_nonfinite(connect(out), 5)) != []


@pytest.mark.parametrize(
    "cells,dtype",
    [
        ([1.0, 2.0, 0.0], None),
        ([float("nan"), 2.0, 0.0], None),
        ([1.0, -float("inf"), 0.0], None),
        ([1.0, 2.0, 3.0], None),  # a NaN count above 0 with finite values
        ([1.0, 2.0, -float("inf")], None),  # a count of -inf is not above 0
        ([1.0, 2.0, float("nan")], None),
        ([None, 2.0, None], None),  # empty cells
        ([float("nan"), 2.0, 1.0], "nan"),  # the reference's "no tensor" row
        ([float("nan"), 2.0, 1.0], "torch.float32"),
    ],
)
def test_row_is_bad_is_the_sql_rule(cells: list[float | None], dtype: str | None) -> None:
    import duckdb

    from trainprobe.engine.sinks.parquet_summary import op_flags, row_is_bad

    columns = ["min", "max", "nans"]
    values = ", ".join("NULL::DOUBLE" if c is None else f"'{c}'::DOUBLE" for c in cells)
    names = ", ".join(f'"{c}"' for c in columns)
    text = "NULL" if dtype is None else literal(dtype)
    sql = f"SELECT {bad_rows_sql(['step', *columns, 'dtype'])} FROM (SELECT {values}, {text} AS dtype) t({names}, dtype)"
    [(expected,)] = duckdb.connect().execute(sql).fetchall()
    assert row_is_bad(op_flags(columns), cells, dtype) is expected
