"""The report's size bound (issue 15.8): a data type with more than ``MAX_TARGETS`` targets draws
that many heatmap rows (NaN/inf targets first, then the largest peaks), the page says so, and the
HTML stays small; counts and onsets still cover every target."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from test_tool_report import assert_page_ok, needs_chromium, render
from trainprobe.tools.reporting import data as report_data
from trainprobe.tools.reporting import digest as report_digest
from trainprobe.tools.reporting import groups as report_groups
from trainprobe.tools.reporting import onsets as report_onsets
from trainprobe.tools.reporting.data import MAX_TARGETS, event_target, load_report_data
from trainprobe.tools.reporting.report import write_report

TARGETS = 20_000
PAGE_LIMIT = 6_000_000  # bytes: Plotly's bundle (~4.8 MB) and the drawn data; no growth with targets
HEADER = "vpp_stage,name,step,min,max,norm,nans,shape,dtype"


def _norms(targets: int, nan_targets: tuple[int, ...]) -> np.ndarray:
    norms = np.random.default_rng(0).uniform(1.0, 2.0, size=targets)
    norms[7] = 50.0
    norms[list(nan_targets)] = 1e-3
    return norms


def write_many_targets(root: Path, targets: int = TARGETS, steps: int = 2, nan_targets: tuple[int, ...] = ()) -> Path:
    """One V1 rank, ``grad_reduced`` of ``targets`` parameters (reference columns); target 7 has
    the largest norm, the ``nan_targets`` the smallest and turn NaN at step 1."""
    run = root / "Jan01_00-00-00-rank0-0a1b2c3d"
    run.mkdir(parents=True)
    norms = _norms(targets, nan_targets)
    for step in range(steps):
        lines = [HEADER]
        for i, n in enumerate(norms):
            cells = "nan,nan,nan,3" if (i in nan_targets and step >= 1) else f"{-n / 9:.6g},{n / 9:.6g},{n:.6g},0"
            lines.append(f'0,layers.{i}.weight,{step},{cells},"[4, 4]",torch.float32')
        (run / f"grad_reduced_{step}-{step}.csv").write_text("\n".join(lines) + "\n")
    return root


def test_many_targets_are_sampled_and_the_page_stays_small(tmp_path):
    root = write_many_targets(tmp_path / "many", nan_targets=(12345,))
    data = load_report_data(root)
    (group,) = data.groups
    assert group.all_targets == TARGETS and len(group.targets) == MAX_TARGETS and group.sampled
    assert group.rows == 2 * TARGETS and group.ranks[0].values.shape == (MAX_TARGETS, 2, 4)
    assert "layers.12345.weight" in group.targets and "layers.7.weight" in group.targets  # NaN, largest peak
    index = [int(t.split(".")[1]) for t in group.targets]
    assert index == sorted(index)  # model order
    norms = group.ranks[0].values[:, 0, 2]
    drawn_smallest = np.sort(norms[np.isfinite(norms) & (norms > 0.01)])[0]
    assert drawn_smallest > 1.9  # the other rows are the largest peaks (uniform 1..2)
    global_norm = group.ranks[0].global_value  # over every target, drawn or not
    expected = np.sqrt(np.sum(_norms(TARGETS, (12345,)) ** 2))
    assert global_norm[0] == pytest.approx(expected, rel=1e-5)
    assert list(group.ranks[0].global_nonfinite) == [False, True]
    path = write_report(root, tmp_path / "many.html")
    text = path.read_text(encoding="utf-8")
    assert path.stat().st_size < PAGE_LIMIT, path.stat().st_size
    assert f'id="tp-sampled" class="bad" data-drawn="{MAX_TARGETS}" data-total="{TARGETS}"' in text
    assert f"sampled: {MAX_TARGETS} of {TARGETS} targets drawn" in text


def test_onsets_kept_are_bounded_and_counted(tmp_path, monkeypatch):
    for module in (report_data, report_digest, report_groups, report_onsets):  # every module that bounds onsets
        monkeypatch.setattr(module, "MAX_ONSETS", 5)
    nan_targets = tuple(range(100, 150))
    data = load_report_data(write_many_targets(tmp_path / "nan", targets=300, nan_targets=nan_targets))
    assert data.onset_count == 50 and len(data.onsets) == 5
    # weight gradients in backward order (engine/execution_order.place): the last layers' first
    assert [event_target(e) for e in data.onsets] == [f"layers.{i}.weight" for i in range(149, 144, -1)]
    (group,) = data.groups
    assert all(f"layers.{i}.weight" in group.targets for i in nan_targets)  # NaN targets always drawn
    assert group.nonfinite_rows == 50 and group.first_onset_step == 1


@needs_chromium
def test_sampled_page_renders_and_says_so(tmp_path):
    path = write_report(write_many_targets(tmp_path / "many", targets=5000), tmp_path / "many.html")
    page = render(path, tmp_path / "chromium", height=1500)
    assert_page_ok(page)
    sampled = page.dom.by_id["tp-sampled"]
    assert (sampled["data-drawn"], sampled["data-total"]) == (str(MAX_TARGETS), "5000")


def _peak_bytes(root: Path) -> int:
    tracemalloc.start()
    try:
        load_report_data(root)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_does_not_grow_with_the_rows_of_a_sampled_data_type(tmp_path):
    """Rows are digested file by file; only the drawn targets' rows are kept (second pass)."""
    short = _peak_bytes(write_many_targets(tmp_path / "short", targets=5000, steps=2))
    long = _peak_bytes(write_many_targets(tmp_path / "long", targets=5000, steps=12))
    assert long < 1.3 * short, (short, long)
