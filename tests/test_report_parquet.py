"""The report reads runs through the query layer: a run converted to Parquet (``trainprobe
convert``) gives the same report data as its CSV files (V1 and V2, two ranks, a NaN), and the
layer's file finder refuses a link to a file outside the folder as the report always has."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("duckdb")
pytest.importorskip("pyarrow")

from reference_layouts import V1_RUN, write_reference_v1  # noqa: E402
from trainprobe.tools.query.convert import convert_run  # noqa: E402
from trainprobe.tools.query.layer import connect, describe  # noqa: E402
from trainprobe.tools.reporting.data import ReportData, load_report_data  # noqa: E402
from trainprobe.tools.reporting.report import write_report  # noqa: E402


def _summary(data: ReportData) -> dict[str, Any]:
    """What the page draws, NaN-safe and without file names."""
    groups = {}
    for g in data.groups:
        groups[g.name] = (
            g.targets,
            g.steps.tolist(),
            g.ops,
            {r: (np.nan_to_num(m.values, nan=-7.0).tolist(), m.nonfinite.tolist(), m.rows) for r, m in g.ranks.items()},
            {r: np.nan_to_num(m.global_value, nan=-7.0).tolist() for r, m in g.ranks.items()},
        )
    onsets = [(e.data["step"], e.data["rank"], e.data["tag_name"], e.data["micro_step"], e.position) for e in data.onsets]
    return {"groups": groups, "onsets": onsets, "ranks": data.ranks, "torn": data.torn}


@pytest.mark.parametrize("layout", ["v1", "v2"])
def test_parquet_run_reports_like_its_csv(monitor_runs: Any, tmp_path: Path, layout: str) -> None:
    run = getattr(monitor_runs, layout)
    parquet = tmp_path / "parquet"
    shutil.copytree(run, parquet)
    convert_run(parquet, remove_csv=True)
    assert not list(parquet.rglob("*.csv")) and list(parquet.rglob("*.parquet"))
    csv_data, parquet_data = load_report_data(run), load_report_data(parquet)
    assert _summary(parquet_data) == _summary(csv_data)
    assert parquet_data.first_nonfinite is not None and parquet_data.first_nonfinite.data["step"] == 4
    page = write_report(parquet, tmp_path / "parquet.html").read_text(encoding="utf-8")
    assert "fc2.bias" in page


def test_the_query_layer_skips_a_link_outside_the_folder(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_reference_v1(tmp_path / "monitor")
    secret = tmp_path / "private" / "actv_grad_0-1.csv"
    secret.parent.mkdir()
    secret.write_text("vpp_stage,name,step,min\n0,SECRET,0,1\n")
    (tmp_path / "monitor" / V1_RUN / "grad_unreduced_0-1.csv").symlink_to(secret)
    con = connect(tmp_path / "monitor")
    assert "grad_unreduced" not in describe(con)
    assert "grad_unreduced_0-1.csv: a link to a file outside" in caplog.text and "skipped (not read)" in caplog.text
