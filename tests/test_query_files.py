"""The run-file finder's errors: an existing folder without monitor data raises ``NoRunFiles``
(a ``ConfigError``), so tools that fall back to something else catch the type, not the text."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.reporting.read import find_report_files
from trainprobe.tools.runs.files import NoRunFiles, find_run_files


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


def test_the_report_words_no_run_files_its_way_and_passes_other_errors_on(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^monitor_path: no monitor CSV found \(nor Parquet\) under "):
        find_report_files(tmp_path)
    with pytest.raises(ConfigError, match=r"^run: .*nope' does not exist$"):
        find_report_files(tmp_path / "nope")
