"""``trainprobe report`` on runs of many ranks (issue #26): the files of a table are read in one
streamed DuckDB scan with the same rows as a file-by-file read, a bad file is still named, and the
page's drawn data is bounded by a page-wide budget however many ranks the run has."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting import read as report_read
from trainprobe.tools.reporting.data import Group, load_report_data
from trainprobe.tools.reporting.figures import (
    PAGE_HEATMAP_CELLS,
    PAGE_LINE_POINTS,
    PICKABLE_LINES,
    bucket_size,
    heatmap_bucket,
    line_bucket,
)
from trainprobe.tools.reporting.read import connection, find_report_files, read_file, read_files
from trainprobe.tools.runs import read as runs_read

HEADER = "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans"
PARAMS = ("embed.weight", "layers.0.q.weight", "layers.0.k.weight", "head.weight")


def write_v2_run(root: Path, ranks: int = 2, windows: int = 3, window: int = 4) -> Path:
    """V2 ``weight_grad`` CSVs: ``ranks`` rank folders of ``windows`` files of ``window`` steps,
    both scopes; rank 1's ``layers.0.k.weight`` norm is NaN at step 5 (reduced)."""
    for rank in range(ranks):
        folder = root / f"rank_{rank}"
        folder.mkdir(parents=True)
        for first in range(0, windows * window, window):
            lines = [HEADER]
            for step in range(first, first + window):
                for scope, micro in (("unreduced", "0"), ("reduced", "")):
                    for i, name in enumerate(PARAMS):
                        norm = "nan" if (rank, step, i, scope) == (1, 5, 2, "reduced") else f"{(1 + i) * (1 + step % 3)}"
                        lines.append(f"0,{step},{name},{scope},{micro},-1.5,{1 + rank},0.25,{norm},0")
            (folder / f"weight_grad_step{first}-{first + window - 1}.csv").write_text("\n".join(lines) + "\n")
    return root


def _same(a: report_read.FileRows, b: report_read.FileRows) -> None:
    assert a.ops == b.ops and a.torn == b.torn and a.shapes == b.shapes
    for column in ("steps", "micro", "vpp"):
        np.testing.assert_array_equal(getattr(a, column), getattr(b, column))
    np.testing.assert_array_equal(a.values, b.values)  # NaN in the same places
    assert a.targets == b.targets
    assert a.scope_codes is not None and b.scope_codes is not None and a.scope_names and b.scope_names
    assert [a.scope_names[c] for c in a.scope_codes] == [b.scope_names[c] for c in b.scope_codes]


def test_one_scan_reads_the_rows_a_file_by_file_read_reads(tmp_path, monkeypatch):
    root = write_v2_run(tmp_path / "run")
    files = find_report_files(root)
    con = connection(files)
    scans: list[int] = []
    bulk = report_read._read_bulk

    def counted(con_, batch):  # type: ignore[no-untyped-def]
        scans.append(len(batch))
        yield from bulk(con_, batch)

    monkeypatch.setattr(report_read, "_read_bulk", counted)
    monkeypatch.setattr(runs_read, "STREAM_ROWS", 7)  # batches cut files: a file spans batches
    got = list(read_files(con, files))
    assert scans == [6]  # one scan: every file of the table (same header), by rank and step
    assert [f for f, _ in got] == files
    for file, rows in got:
        _same(rows, read_file(con, file))
        assert len(rows.steps) == 4 * 2 * len(PARAMS)


def test_a_scan_left_early_frees_its_connection(tmp_path):
    """The scan reads its next batch in a thread while the caller works on this one; a caller
    that stops early (an error in its own work) gets the connection back idle, at once."""
    root = write_v2_run(tmp_path / "run")
    files = find_report_files(root)
    con = connection(files)
    scan = read_files(con, files)
    first, rows = next(scan)
    scan.close()
    _same(read_file(con, files[-1]), read_file(con, files[-1]))
    _same(rows, read_file(con, first))
    assert [f for f, _ in read_files(con, files)] == files


def test_a_bad_file_among_many_is_named(tmp_path):
    root = write_v2_run(tmp_path / "run")
    bad = root / "rank_1" / "weight_grad_step4-7.csv"
    bad.write_text(bad.read_text().replace("-1.5", "not-a-number", 1))
    with pytest.raises(ConfigError, match=r"rank_1/weight_grad_step4-7\.csv: not a monitor file DuckDB can read"):
        load_report_data(root)


def test_the_report_data_of_a_run_read_in_one_scan(tmp_path):
    data = load_report_data(write_v2_run(tmp_path / "run"))
    groups = {g.name: g for g in data.groups}
    assert set(groups) == {"weight_grad/unreduced", "weight_grad/reduced"}
    reduced = groups["weight_grad/reduced"]
    assert reduced.targets == list(PARAMS) and list(reduced.steps) == list(range(12))
    assert reduced.rows == 2 * 12 * len(PARAMS) and reduced.nonfinite_rows == 1 and reduced.first_onset_step == 5
    matrix = reduced.ranks[1]
    assert matrix.values.dtype == np.float32  # the precision the page draws: half the memory
    assert matrix.nonfinite[2, 5, reduced.ops.index("norm")] and np.isnan(matrix.values[2, 5, 3])
    assert matrix.values[3, 4, reduced.ops.index("norm")] == 8.0  # head.weight at step 4: 4 * (1 + 4 % 3)
    first = data.first_nonfinite
    assert first is not None and (first.data["rank"], first.data["step"]) == (1, 5)


def _group(ranks: int, steps: int, targets: int, ops: int) -> Group:
    return Group(
        name="weight_grad/reduced",
        table="grad_reduced",
        phase="backward",
        ops=tuple(f"op{i}" for i in range(ops)),
        targets=[f"p{i}" for i in range(targets)],
        steps=np.arange(steps),
        ranks=dict.fromkeys(range(ranks)),  # type: ignore[arg-type]  # only their number counts here
    )


def test_the_page_draws_a_bounded_number_of_cells_and_points_however_many_ranks():
    """bench/bench_query.py's run: 32 ranks x 500 steps x 100 parameters, 5 ops, 2 scopes. The
    page drew 5.3 M heatmap cells and 1.6 M line points (a 58 MB page); now about 1 M and 0.4 M."""
    group = _group(ranks=32, steps=500, targets=100, ops=5)
    columns = -(-500 // heatmap_bucket(group, 2))
    cells = 2 * 5 * 32 * 100 * columns
    assert columns >= 20 and cells <= 1.1 * PAGE_HEATMAP_CELLS and PAGE_HEATMAP_CELLS <= 1_000_000
    points = -(-500 // line_bucket(group, 2))
    lines = 2 * 5 * 32 * PICKABLE_LINES * points
    assert points >= 20 and lines <= 1.1 * PAGE_LINE_POINTS and PAGE_LINE_POINTS <= 400_000
    small = _group(ranks=2, steps=500, targets=20, ops=5)  # a small run keeps every step
    assert heatmap_bucket(small, 2) == 1 and line_bucket(small, 2) == bucket_size(500, 1000)
