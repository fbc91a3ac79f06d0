"""``make test`` runs every phase and reports each (.ci/phases.sh), failing when any failed; CI's
``.ci/run`` runs the README's test command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ROOT / ".ci" / "phases.sh"


def _phases(tmp_path: Path, *specs: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(PHASES), *specs], cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_every_phase_runs_after_a_failure_and_each_is_reported(tmp_path: Path) -> None:
    done = _phases(tmp_path, "lint=touch lint", "PyTorch suite=touch torch; exit 3", "interop=touch interop")
    assert done.returncode == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["interop", "lint", "torch"]  # all three ran
    summary = done.stdout[done.stdout.index("=== 3 phases in ") :].splitlines()
    assert re.fullmatch(r"=== 3 phases in \d+ s:", summary[0])
    assert [re.fullmatch(r"  (.+?) +(passed|FAILED) +\d+ s", line).groups() for line in summary[1:4]] == [  # type: ignore[union-attr]
        ("lint", "passed"),
        ("PyTorch suite", "FAILED"),
        ("interop", "passed"),
    ]
    assert summary[4] == "FAILED: PyTorch suite"


def test_all_passed_is_exit_0_and_minutes_are_said(tmp_path: Path) -> None:
    done = _phases(tmp_path, "one=true", "two=true")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "all passed"
    minutes = subprocess.run(
        ["bash", "-c", f"source <(sed -n '/^duration()/,/^}}/p' {PHASES}); duration 754"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert minutes.stdout == "12 min 34 s"


def test_make_test_runs_the_four_phases_and_ci_runs_the_readme_command() -> None:
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    recipe = makefile[makefile.index("\ntest: ") :].split("\n\n")[0]
    assert re.findall(r'"([^"=]+)=\$\(MAKE_PHASE\) ([\w-]+)"', recipe) == [
        ("lint", "lint"),
        ("PyTorch suite", "pytest-torch"),
        ("MindSpore suite", "test-mindspore"),
        ("interop", "interop"),
    ]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "make test   # " in readme
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()
    assert ci[-1] == "make test"
