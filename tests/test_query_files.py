"""The run-file finder's errors: an existing folder without monitor data raises ``NoRunFiles``
(a ``ConfigError``), so tools that fall back to something else catch the type, not the text."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.read import find_report_files
from trainprobe.tools.runs.files import NoRunFiles, RunFile, find_run_files, walk_run
from trainprobe.tools.runs.selection import find_csv_files, find_monitor_files


def test_a_folder_without_data_files_raises_no_run_files(tmp_path: Path) -> None:
    (tmp_path / "rank_0").mkdir()
    (tmp_path / "rank_0" / "notes.csv").write_text("a,b\n1,2\n", encoding="utf-8")
    with pytest.raises(NoRunFiles, match=r"^run: no monitor data file \(\.csv or \.parquet\) under .*looked for"):
        find_run_files(tmp_path)
    assert issubclass(NoRunFiles, ConfigError)  # every caller catching ConfigError still catches it


@pytest.mark.parametrize("make", ["missing", "file"])
def test_a_missing_folder_or_a_file_is_not_no_run_files(tmp_path: Path, make: str) -> None:
    path = tmp_path / "run"
    if make == "file":
        path.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError, match="does not exist|is not a folder") as raised:
        find_run_files(path)
    assert not isinstance(raised.value, NoRunFiles)


def test_the_report_finds_its_files_through_the_one_walk(tmp_path: Path) -> None:
    with pytest.raises(NoRunFiles, match=r"^run: no monitor data file \(\.csv or \.parquet\) under "):
        find_report_files(tmp_path)
    with pytest.raises(ConfigError, match=r"^run: .*nope' does not exist$"):
        find_report_files(tmp_path / "nope")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


V2_HEADER = "vpp_stage,step,module_name,scope,norm\n"


def test_every_finder_is_a_selection_over_one_walk(tmp_path: Path) -> None:
    """One walk describes each file once (path, rank, layout, table, window, format); the query
    layer's finder prefers a window's Parquet twin, the CSV finder keeps every CSV, the monitor
    finder selects by data type."""
    csv = _write(tmp_path / "rank_1" / "weight_grad_step0-9.csv", V2_HEADER + "0,0,w,g,1.0\n")
    _write(tmp_path / "rank_1" / "weight_grad_step0-9.parquet", "not read here")
    other = _write(tmp_path / "rank_0" / "param_step10-19.csv", V2_HEADER + "0,10,w,p,1.0\n")
    walk = walk_run(tmp_path)
    assert sorted(f.path.name for f in walk.files) == [
        "param_step10-19.csv", "weight_grad_step0-9.csv", "weight_grad_step0-9.parquet"
    ]
    found = {f.path.name: f for f in walk.files}
    assert found["param_step10-19.csv"] == RunFile(other, "v2", "csv", 0, "param", 10, 19, tmp_path)
    assert found["param_step10-19.csv"].window == (10, 19) and found["param_step10-19.csv"].run == "rank_0"
    assert [f.path.name for f in find_run_files(tmp_path)] == ["param_step10-19.csv", "weight_grad_step0-9.parquet"]
    assert [f.path for f in find_csv_files(tmp_path)] == [other, csv]  # by rank
    assert [f.path.name for f in find_monitor_files(tmp_path, data_types=["weight_grad"])] == [
        "weight_grad_step0-9.parquet"
    ]
    with pytest.raises(NoRunFiles, match=r"^monitor_path: no monitor CSV of data types \['actv'\] found"):
        find_monitor_files(tmp_path, data_types=["actv"])


def test_no_finder_matches_error_text() -> None:
    """Finders raise types; no module of the tools decides by an exception's message."""
    root = Path(__file__).resolve().parents[1] / "src" / "trainprobe" / "tools"
    offenders = [
        f"{path.relative_to(root)}:{number}"
        for path in sorted(root.rglob("*.py"))
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if re.search(r"\bin str\((e|exc|error)\)|str\((e|exc|error)\)\.startswith", line)
    ]
    allowed = {"runs/rows.py"}  # the csv module says "unexpected end of data" only in its text
    assert [o for o in offenders if o.split(":")[0] not in allowed] == []
