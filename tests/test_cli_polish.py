"""The command as a person meets it: --version, demo --help, a reader that goes away."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from trainprobe.cli import BROKEN_PIPE


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "trainprobe", *args], capture_output=True, text=True, timeout=120)


def test_version_prints_the_installed_version() -> None:
    done = run("--version")
    assert done.returncode == 0
    assert done.stdout.strip().startswith("trainprobe ") and done.stdout.strip() != "trainprobe unknown (not installed)"


def test_help_does_not_read_the_package_metadata() -> None:
    """``importlib.metadata`` (a third of ``--help``'s time) is loaded for ``--version`` only."""
    code = (
        "import sys\nfrom trainprobe.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print('metadata loaded', 'importlib.metadata' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "metadata loaded False"


def test_demo_help_describes_the_command() -> None:
    done = run("demo", "--help")
    assert done.returncode == 0
    assert "Train a small GPT" in done.stdout and "Monitor V2" in done.stdout and "--steps" in done.stdout


def _anomaly_tree(root: Path, events: int) -> Path:
    folder = root / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    data = {
        f"0:fc{s % 7}.input:0/rank0/actv_step_{s}_call_{s}": {
            "rank": 0, "step": s, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": s,
            "tag_name": f"0:fc{s % 7}.input:0/rank0/actv", "message": "Rule AnomalyTurbulence reports anomaly signal",
            "group_mates": [0],
        }
        for s in range(events)
    }  # fmt: skip
    (folder / "anomaly.json").write_text(json.dumps(data), encoding="utf-8")
    return root / "anomaly_detected"


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path) -> None:
    """``trainprobe anomaly-analyse ... | head -0``: the reader is gone before the table is printed."""
    data = _anomaly_tree(tmp_path, 3000)
    child = subprocess.Popen(
        [sys.executable, "-m", "trainprobe", "anomaly-analyse", "-d", str(data), "-o", str(tmp_path / "out"),
         "-k", "3000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    stderr = child.stderr.read()
    code = child.wait(timeout=120)
    assert stderr == "", stderr
    assert code == BROKEN_PIPE
