"""``trainprobe diagnose``'s default spike rule (``recent_max``, engine/rules' DEFAULT_RULE) on
real runs of the detection benchmark (bench/bench_detection.py, issue #34): a x100 input jump at
step 9, inside the median rule's 10-value warm-up, is named at step 9 on the layer it entered,
where ``--rule median`` names its after-effect (step 10's ``exp_avg``); a healthy run whose
output projections start at zero exits 0, where the median rule cries wolf."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from trainprobe.tools.diagnosis.answer import diagnose

pytest.importorskip("duckdb")
BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_detection.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_detection", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_detection"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    bench = _bench()
    specs = {s.name: s for s in bench.RUNS}
    base = tmp_path_factory.mktemp("default_rule")
    out = {}
    for name in ("mlp_x100_s9", "gpt_zero_init"):
        bench.make_run(specs[name], base / name)
        out[name] = base / name
    return out


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainprobe", "diagnose", *args], capture_output=True, text=True, timeout=300
    )


def test_a_x100_jump_at_step_9_is_named_at_its_step(runs: dict[str, Path]) -> None:
    result = diagnose(runs["mlp_x100_s9"])
    first = result.first
    assert first is not None and result.rule == "recent_max"
    assert (first.kind, first.step, first.rank, first.table, first.scope) == ("spike", 9, 0, "module", "forward")
    assert first.name == ".input.0"  # the model's input: where the x100 batch entered
    assert first.value is not None and first.median is not None and first.value / first.median > 50
    assert result.line().endswith("x its recent max " + f"{first.median:.6g}" + " (spike, recent_max)")
    # the median rule is blind inside its warm-up: it names the after-effect, a step late
    median = diagnose(runs["mlp_x100_s9"], rule="median").first
    assert median is not None and (median.step, median.table, median.scope) == (10, "optimizer", "exp_avg")
    done = _cli(str(runs["mlp_x100_s9"]))
    assert done.returncode == 1 and done.stdout.splitlines()[0] == result.line(), done.stdout + done.stderr


def test_a_healthy_zero_init_run_exits_0(runs: dict[str, Path]) -> None:
    done = _cli(str(runs["gpt_zero_init"]))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("no anomaly: no NaN/inf and no spike by the rule recent_max in 1 rank(s)")
    # the median rule calls the projections' growth from zero a spike
    assert _cli(str(runs["gpt_zero_init"]), "--rule", "median").returncode == 1
