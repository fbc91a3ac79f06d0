"""``trainprobe demo --fault spike|nan``: a run with something to find, and the commands it prints
(diagnose, report, diff against a clean demo run) run as printed, from the folder the demo ran in."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from trainprobe.cli import main

pytest.importorskip("duckdb")


def _trainprobe(cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def _printed_commands(stdout: str, heading: str) -> list[list[str]]:
    """The commands the demo printed under ``heading``, as argument lists without ``trainprobe``
    (a trailing ``# comment`` dropped, as a shell would)."""
    lines = stdout.splitlines()
    start = lines.index(heading) + 1
    commands = []
    for line in lines[start:]:
        if not line.startswith("  trainprobe "):
            break
        words = shlex.split(line, comments=True)
        commands.append(words[1:])
    return commands


def test_a_spike_demo_is_found_at_its_step_by_the_commands_it_prints(tmp_path: Path) -> None:
    clean = _trainprobe(tmp_path, "demo", "--steps", "12")
    assert clean.returncode == 0, clean.stderr
    assert "No NaN found." in clean.stdout
    assert _printed_commands(clean.stdout, "Next:") == [
        ["diagnose", "trainprobe_demo"],
        ["report", "trainprobe_demo", "-o", "trainprobe_demo/report.html"],
        ["demo", "--fault", "spike"],
    ]
    faulty = _trainprobe(tmp_path, "demo", "--steps", "12", "--fault", "spike", "--fault-step", "10")
    assert faulty.returncode == 0, faulty.stderr
    assert "fault: step 10's batch reached the first block 1000x too large (a spike)" in faulty.stdout
    assert "under trainprobe_demo_spike/" in faulty.stdout
    commands = _printed_commands(faulty.stdout, "Find the fault:")
    assert commands == [
        ["diagnose", "trainprobe_demo_spike"],
        ["report", "trainprobe_demo_spike", "-o", "trainprobe_demo_spike/report.html"],
        ["diff", "trainprobe_demo", "trainprobe_demo_spike"],
    ]
    diagnosed, reported, diffed = (_trainprobe(tmp_path, *command) for command in commands)
    assert diagnosed.returncode == 1, diagnosed.stderr
    assert diagnosed.stdout.startswith("first anomaly: step 10, rank 0, module/forward layers.0.input.0: norm = ")
    assert "(spike" in diagnosed.stdout.splitlines()[0]
    assert "ranks: the only rank (step 10)" in diagnosed.stdout.splitlines()  # a 1-rank run has no "alone first"
    assert "alone first" not in diagnosed.stdout
    assert reported.returncode == 0, reported.stderr
    assert (tmp_path / "trainprobe_demo_spike" / "report.html").stat().st_size > 0
    assert diffed.returncode == 1, diffed.stderr
    assert diffed.stdout.startswith("first divergence: step 10, rank 0, module forward layers.0.input.0 ")
    fine = _trainprobe(tmp_path, "diagnose", "trainprobe_demo")
    assert fine.returncode == 0, fine.stderr
    assert fine.stdout.startswith("no anomaly:")


def test_a_nan_demo_is_found_at_its_step_and_says_how_to_make_a_clean_run(tmp_path: Path) -> None:
    faulty = _trainprobe(tmp_path, "demo", "--steps", "6", "--fault", "nan", "--fault-step", "4", "--out", "my run")
    assert faulty.returncode == 0, faulty.stderr
    assert "fault: step 4's gradient of layers.1.mlp.fc1.weight got a NaN before optimizer.step()" in faulty.stdout
    assert "NaN found in " in faulty.stdout
    commands = _printed_commands(faulty.stdout, "Find the fault:")
    assert commands == [
        ["diagnose", "my run"],
        ["report", "my run", "-o", "my run/report.html"],
        ["demo", "--out", "trainprobe_demo"],
        ["diff", "trainprobe_demo", "my run"],
    ]
    diagnosed = _trainprobe(tmp_path, *commands[0])
    assert diagnosed.returncode == 1, diagnosed.stderr
    first = diagnosed.stdout.splitlines()[0]
    assert first.startswith("first anomaly: step 4, rank 0, weight_grad") and "layers.1.mlp.fc1.weight" in first
    assert "nan" in first.lower()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--fault-step", "5"], r"--fault-step: needs --fault spike or --fault nan"),
        (["--fault", "nan", "--fault-step", "50"], r"--fault-step: must be between 1 and 49 \(--steps 50\), got 50"),
        (["--fault", "nan", "--fault-step", "0"], r"--fault-step: must be between 1 and 49 \(--steps 50\), got 0"),
        (["--fault", "spike", "--fault-step", "9"], r"--fault-step: a spike at step 9 cannot be found: .* use 10 or more"),
        (["--fault", "spike", "--steps", "20"], r"--fault-step: must be between 1 and 19 \(--steps 20\), got 30"),
    ],
)
def test_bad_fault_options_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main(["demo", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("trainprobe demo: error: ")
    assert re.search(message, err), err
    assert not (tmp_path / "out").exists()


def test_an_unknown_fault_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--fault", "oom"])
    assert exited.value.code == 2
    assert re.search(r"argument --fault: invalid choice: 'oom' \(choose from '?spike'?, '?nan'?\)", capsys.readouterr().err)
