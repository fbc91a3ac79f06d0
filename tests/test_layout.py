"""``trainprobe.engine.layout``: the names the monitors write are the names the tools read back."""

from __future__ import annotations

import ast
from datetime import datetime

import pytest

import trainprobe.engine.layout as layout
from trainprobe.engine.sinks import csv_sink
from trainprobe.frontdoors.monitor_v1 import output
from trainprobe.frontdoors.monitor_v2.config import MONITOR_NAMES


def test_written_names_read_back() -> None:
    stamp = layout.format_stamp(datetime(2026, 2, 28, 21, 34, 40))
    run = layout.V1_RUN.fullmatch(layout.v1_run_folder(stamp, 12, "1a2b3c4d"))
    assert run and (run["stamp"], run["rank"], run["id"]) == ("Feb28_21-34-40", "12", "1a2b3c4d")
    v1 = layout.V1_FILE.fullmatch(layout.v1_file_name("grad_reduced", 0, 4))
    assert v1 and (v1["type"], v1["first"], v1["last"]) == ("grad_reduced", "0", "4")
    v2 = layout.V2_FILE.fullmatch(layout.v2_file_name("weight_grad", 10, 19))
    assert v2 and (v2["type"], v2["first"], v2["last"]) == ("weight_grad", "10", "19")
    rank = layout.V2_RANK.fullmatch(layout.v2_rank_folder(3))
    assert rank and rank["rank"] == "3"
    anomaly = layout.ANOMALY_RANK.fullmatch(layout.anomaly_rank_folder(1))
    assert anomaly and anomaly[1] == "1"


def test_stamps_are_read_in_a_leap_year() -> None:
    assert layout.parse_stamp("Feb29_00-00-00") == datetime(2000, 2, 29)
    with pytest.raises(ValueError, match="does not match format|day is out of range"):
        layout.parse_stamp("Feb30_00-00-00")


def test_the_writers_use_it() -> None:
    assert output.TABLES == layout.V1_TABLES and output.KEY_COLUMNS == layout.V1_KEY_COLUMNS
    assert output.file_name("actv", 0, 1) == layout.v1_file_name("actv", 0, 1)
    assert csv_sink.file_name("module", 0, 1) == layout.v2_file_name("module", 0, 1)
    assert csv_sink.TableLayout(False, ("min",)).key_columns == layout.V2_KEY_COLUMNS
    assert MONITOR_NAMES == layout.V2_MONITORS


def test_it_imports_only_the_standard_library() -> None:
    tree = ast.parse(open(layout.__file__, encoding="utf-8").read())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "re", "datetime"}
