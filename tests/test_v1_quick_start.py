"""docs/monitor_v1.md's first example, run as written: it selects modules and writes activation
files, with no "no module is selected" warning (the example had ``targets: {}`` without ``all_xy``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "monitor_v1.md"


def _example() -> tuple[str, str]:
    text = DOC.read_text(encoding="utf-8")
    config = re.search(r"`monitor_config\.json`:\n\n```json\n(.*?)```", text, re.S)
    script = re.search(r"```python\n(.*?)```", text, re.S)
    assert config and script
    return config[1], script[1]


@pytest.mark.parametrize("targets", [None, {"0": {}, "2": {}}])
def test_the_v1_quick_start_writes_activations(tmp_path: Path, targets: dict[str, dict[str, str]] | None) -> None:
    config, script = _example()
    if targets is not None:  # the variant the page offers: a few modules named in targets
        config = json.dumps({"targets": targets, "xy_distribution": True, "wg_distribution": True})
    (tmp_path / "monitor_config.json").write_text(config, encoding="utf-8")
    (tmp_path / "train.py").write_text(script, encoding="utf-8")
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "no module is selected" not in done.stderr
    (run,) = (tmp_path / "monitor_output").iterdir()
    names = sorted(p.name for p in run.glob("*.csv"))
    assert [n for n in names if n.startswith("actv_") and not n.startswith("actv_grad")] == [f"actv_{s}-{s}.csv" for s in range(3)]
    rows = (run / "actv_0-0.csv").read_text(encoding="utf-8").splitlines()
    modules = {row.split(",")[1].rsplit(".", 1)[0] for row in rows[1:]}
    assert {"0", "2"} <= modules
    assert any(n.startswith("actv_grad_") for n in names) and any(n.startswith("grad_reduced_") for n in names)
