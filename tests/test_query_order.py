"""The query layer orders rows exactly as :func:`trainprobe.engine.execution_order.execution_key`:
its SQL is generated from that module, and on real V1 and V2 runs (two gloo ranks, several tables,
micro-steps) every row's SQL key equals the Python key and both sort the rows identically."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("duckdb")

from reference_layouts import write_reference_v1  # noqa: E402
from trainprobe.engine.execution_order import V2_DEFAULT_TABLE, execution_key, row_positions, table_of  # noqa: E402
from trainprobe.tools.query.layer import connect, describe  # noqa: E402
from trainprobe.tools.sql.questions import first_nonfinite_sql, ordered_rows_sql  # noqa: E402


def _python_keys(rows: list[dict[str, Any]]) -> list[tuple[int, ...]]:
    """``execution_key`` of every row, positions counted per file in file order (row_positions)."""
    positions: dict[tuple[str, int], int] = {}
    by_file: dict[str, list[int]] = {}
    for n, row in enumerate(rows):
        by_file.setdefault(row["file"], []).append(n)
    for file, members in by_file.items():
        members.sort(key=lambda n: rows[n]["file_row"])
        for n, pos in zip(members, row_positions(rows[n]["step"] for n in members)):
            positions[file, rows[n]["file_row"]] = pos
    keys = []
    for row in rows:
        view = row["tbl"]
        table = table_of(view, row["scope"]) if view in V2_DEFAULT_TABLE else view
        keys.append(
            execution_key(
                row["step"],
                table,
                target=row["name"],
                micro_step=row["micro_step"],
                position=positions[row["file"], row["file_row"]],
                rank=row["rank"],
                vpp_stage=row["vpp_stage"],
            )
        )
    return keys


def _check_same_order(run: Path) -> int:
    con = connect(run)
    views = {v: [c for c, _ in cols] for v, cols in describe(con).items()}
    result = con.execute(ordered_rows_sql(views))
    names = [d[0] for d in result.description]
    rows = [dict(zip(names, r)) for r in result.fetchall()]
    keys = _python_keys(rows)
    sql_keys = [
        (r["step"], r["x_once"], r["x_micro"], r["x_phase"], r["x_stage"], 0, r["x_table"], r["x_position"], r["rank"])
        for r in rows
    ]
    assert sql_keys == keys  # execution_key carries pp_stage (0 here) after vpp_stage
    python_order = sorted(range(len(rows)), key=lambda n: (keys[n], rows[n]["tbl"], rows[n]["name"]))
    assert python_order == list(range(len(rows)))
    return len(rows)


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_sql_and_execution_key_order_real_runs_identically(monitor_runs: Any, layout: str) -> None:
    run = getattr(monitor_runs, layout)
    con = connect(run)
    views = describe(con)
    assert len(views) >= 5
    assert con.execute(f'SELECT count(DISTINCT rank) FROM "{next(iter(views))}"').fetchall() == [(2,)]
    if layout == "v1":
        assert con.execute("SELECT max(micro_step) FROM actv").fetchall() == [(1,)]  # two micro-batches
    assert _check_same_order(run) > 100


def test_reference_v1_layout_orders_as_execution_key(tmp_path: Path) -> None:
    write_reference_v1(tmp_path / "ref")
    assert _check_same_order(tmp_path / "ref") > 0


def test_first_nonfinite_follows_the_same_order(monitor_runs: Any) -> None:
    """The first non-finite rows are the non-finite rows of ordered_rows_sql, in its order."""
    con = connect(monitor_runs.v1)
    views = {v: [c for c, _ in cols] for v, cols in describe(con).items()}
    [(step,)] = con.execute("SELECT min(step) FROM grad_reduced WHERE isnan(norm)").fetchall()
    first = con.execute(first_nonfinite_sql(views, step, limit=50)).fetchall()
    assert len(first) > 3
    ordered = con.execute(f"SELECT tbl, rank, file, position FROM ({ordered_rows_sql(views, step)})").fetchall()
    bad = [(r[0], r[4], r[10], r[11]) for r in first]  # table, rank, file, position
    assert [r for r in ordered if r in set(bad)] == bad


def test_micro_step_and_phase_come_before_the_table(tmp_path: Path) -> None:
    """A NaN in a micro-step's activations ran before one in the parameters before the optimizer
    step (``param_origin``, optimizer phase), and micro-step 0's backward before micro-step 1's
    forward: the order execution_order defines (the earlier SQL put ``param_origin`` first and
    the micro-step after the table)."""
    run = tmp_path / "Nov25_06-27-30-rank0-0c5cd257"
    run.mkdir()
    head = "vpp_stage,name,step,micro_step,min,max,norm,nans\n"
    (run / "actv_0-0.csv").write_text(head + "0,fc1.input,0,0,1,1,1,0\n0,fc1.input,0,1,nan,1,1,1\n")
    (run / "actv_grad_0-0.csv").write_text(head + "0,fc1.input,0,0,1,inf,1,0\n0,fc1.input,0,1,1,1,1,0\n")
    (run / "param_origin_0-0.csv").write_text("vpp_stage,name,step,min,max,norm,nans\n0,fc1.weight,0,nan,1,1,1\n")
    con = connect(tmp_path)
    views = {v: [c for c, _ in cols] for v, cols in describe(con).items()}
    first = con.execute(first_nonfinite_sql(views, 0, limit=3)).fetchall()
    assert [(r[0], r[3]) for r in first] == [("actv_grad", 0), ("actv", 1), ("param_origin", None)]
    assert _check_same_order(tmp_path) == 5
