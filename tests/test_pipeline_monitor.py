"""The module monitor under ``torch.distributed.pipelining`` (issue #32): GPipe, 1F1B and
Interleaved1F1B on two gloo ranks, the ``PipelineStage`` objects passed to ``start(model=...)``.

* torch's metadata-inference forward (the first step runs each stage once on placeholder inputs,
  ``torch.empty``, before the schedule's micro-batches) is not recorded: every step, step 0
  included, has the same rows, ``micro_step`` 0 .. M-1, each row the statistics of the schedule's
  micro-batch (checked against the chunk's real inputs, outputs and output gradients, captured
  by the test's own hooks, float64);
* chunks are named by their global stage index (``vpp_stage`` and the ``<stage>:`` prefix): rank 1
  holds stage 1 (GPipe, 1F1B) or stages 1 and 3 (interleaved);
* ``weight_grad``'s ``unreduced`` rows are M times the ``reduced`` ones: the schedule divides the
  accumulated gradients by M (``scale_grads``) after the last backward (docs/parallelism.md);
* training is bitwise the unmonitored one; no hook is left after ``stop()``;
* a plain submodule run by a schedule is named by its chunk index, with one warning saying to
  pass the stage; a list mixing stages and modules is refused (checked in the workers).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from conftest import rows_of, stats64
from models import no_hooks_left
from test_distributed_v2 import launch
from trainprobe import TrainerMonitorV2
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.probes.module import ModuleProbe

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo is not available"
)

WORLD = 2
STEPS = 4
M = 4  # micro-batches per step
D = 8
BATCH = 8
OPS = ["min", "max", "mean", "norm"]
SCHEDULES = ("gpipe", "1f1b", "interleaved")


def stage_indices(schedule: str, rank: int) -> list[int]:
    """The global stages rank ``rank`` holds: one per rank, or two interleaved (r, r + 2)."""
    return [rank, rank + WORLD] if schedule == "interleaved" else [rank]


def build(schedule: str, rank: int) -> tuple[list[nn.Module], list[Any], Any, torch.optim.Optimizer]:
    """This rank's chunks (initialised from their stage index), stages, schedule and optimizer."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    indices = stage_indices(schedule, rank)
    n_stages = WORLD * len(indices)
    chunks: list[nn.Module] = []
    for index in indices:
        torch.manual_seed(100 + index)
        chunks.append(nn.Sequential(nn.Linear(D, D), nn.Tanh()))
    stages = [PipelineStage(c, i, n_stages, torch.device("cpu")) for c, i in zip(chunks, indices)]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).pow(2).mean()

    if schedule == "gpipe":
        runner: Any = ScheduleGPipe(stages[0], M, loss_fn=loss_fn)
    elif schedule == "1f1b":
        runner = Schedule1F1B(stages[0], M, loss_fn=loss_fn)
    else:
        runner = ScheduleInterleaved1F1B(stages, M, loss_fn=loss_fn)
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=0.1, momentum=0.9)
    return chunks, stages, runner, opt


def train(rank: int, runner: Any, opt: torch.optim.Optimizer, clock: list[int], steps: int = STEPS) -> None:
    """``steps`` optimizer steps, each one schedule step over ``M`` micro-batches (same data on
    every run); ``clock[0]`` is the step running."""
    gen = torch.Generator().manual_seed(7)
    for step in range(steps):
        clock[0] = step
        x, y = torch.randn(BATCH, D, generator=gen), torch.randn(BATCH, D, generator=gen)
        if rank == 0:
            runner.step(x)
        else:
            runner.step(target=y)
        opt.step()
        opt.zero_grad()


class Capture:
    """Every call of each chunk: the step, float64 statistics of its input, output and the
    output's gradient (a tensor hook that only reads). Reading hooks change no value."""

    def __init__(self, chunks: list[nn.Module], indices: list[int], clock: list[int]) -> None:
        self.calls: dict[int, list[dict[str, Any]]] = {i: [] for i in indices}
        self.handles = [c.register_forward_hook(self._hook(i, clock)) for c, i in zip(chunks, indices)]

    def _hook(self, index: int, clock: list[int]) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> None:
            call: dict[str, Any] = {"step": clock[0], "input": stats64(args[0]), "output": stats64(out)}
            if out.requires_grad:
                out.register_hook(lambda g: call.__setitem__("grad_output", stats64(g)))
            self.calls[index].append(call)

        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def warnings_said() -> Iterator[list[str]]:
    """The trainprobe logger's warnings meanwhile."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logging.getLogger("trainprobe").addHandler(handler)
    try:
        yield said
    finally:
        logging.getLogger("trainprobe").removeHandler(handler)


def monitor(out: Path) -> TrainerMonitorV2:
    return TrainerMonitorV2(
        {"output_dir": str(out), "monitors": {"module": {"ops": OPS}, "weight_grad": {"enabled": True, "ops": OPS}}}
    )


def expected_rows(capture: Capture) -> tuple[dict[str, list[float]], dict[str, int]]:
    """The rows the monitor should write, ``"<step>|<name>|<scope>|<micro>"`` → statistics: the
    schedule's calls only (the first call of step 0, the metadata inference, left out), and how
    many calls each chunk saw at step 0."""
    expected: dict[str, list[float]] = {}
    step0: dict[str, int] = {}
    for index, calls in capture.calls.items():
        step0[str(index)] = sum(1 for c in calls if c["step"] == 0)
        real = calls[step0[str(index)] - M :] if step0[str(index)] > M else calls
        by_step: dict[int, int] = Counter()
        for call in real:
            step, micro = call["step"], by_step[call["step"]]
            by_step[step] += 1
            for kind, scope in (("input", "forward"), ("output", "forward"), ("grad_output", "backward")):
                if kind in call:
                    values = [call[kind][op] for op in OPS]
                    expected[f"{step}|{index}:.{kind}.0|{scope}|{micro}"] = values
    return expected, step0


def run(rank: int, root: Path, schedule: str) -> None:
    """The monitored run (with the capture) and the unmonitored one; results into ``root``."""
    clock = [0]
    chunks, stages, runner, opt = build(schedule, rank)
    capture = Capture(chunks, stage_indices(schedule, rank), clock)
    mon = monitor(root / schedule)
    with warnings_said() as said:
        mon.start(model=stages if len(stages) > 1 else stages[0], optimizer=opt, micro_batch_number=M)
        (probe,) = [p for p in mon._session.probes if isinstance(p, ModuleProbe)]
        train(rank, runner, opt, clock)
        mon.stop()
    capture.remove()
    expected, step0 = expected_rows(capture)
    ref_chunks, _, ref_runner, ref_opt = build(schedule, rank)
    train(rank, ref_runner, ref_opt, [0])
    result = {
        "expected": expected,
        "step0_calls": step0,
        "warnings": said,
        "bitwise": all(torch.equal(a, b) for c, r in zip(chunks, ref_chunks) for a, b in zip(c.parameters(), r.parameters())),
        "no_hooks_left": all(no_hooks_left(c) for c in chunks) and probe.hooked_tensors() == 0,
    }
    (root / f"{schedule}_rank{rank}.json").write_text(json.dumps(result))


def unstaged(rank: int, root: Path) -> None:
    """A plain submodule under a schedule (warned once), and a list mixing a stage and a module."""
    chunks, stages, runner, opt = build("gpipe", rank)
    mon = TrainerMonitorV2({"output_dir": str(root / "unstaged"), "monitors": {"module": {"ops": OPS}}})
    mixed = TrainerMonitorV2({"output_dir": str(root / "mixed"), "monitors": {"module": {"ops": OPS}}})
    mixed_list = r"start\(model=\.\.\.\): a list of pipeline stages or of torch\.nn\.Modules, not a mix of both"
    with pytest.raises(ConfigError, match=mixed_list):
        mixed.start(model=[stages[0], nn.Linear(2, 2)], optimizer=opt)
    with warnings_said() as said:
        mon.start(model=chunks[0], optimizer=opt)
        train(rank, runner, opt, [0], steps=2)
        mon.stop()
    (root / f"unstaged_rank{rank}.json").write_text(json.dumps({"warnings": said}))


def entry(rank: int, root: Path) -> None:
    for schedule in SCHEDULES:
        run(rank, root, schedule)
        dist.barrier()
    unstaged(rank, root)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pipeline")
    launch(entry, root, timeout=400, world=WORLD)
    return root


def result(root: Path, schedule: str, rank: int) -> dict[str, Any]:
    return json.loads((root / f"{schedule}_rank{rank}.json").read_text())


def module_rows(root: Path, schedule: str, rank: int) -> list[dict[str, str]]:
    return rows_of(root / schedule, "module", rank)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rows_per_step_constant_no_metadata_micro_batch(runs: Path, schedule: str) -> None:
    for rank in range(WORLD):
        rows = module_rows(runs, schedule, rank)
        per_step: dict[str, Counter[tuple[str, str, str]]] = {}
        for r in rows:
            per_step.setdefault(r["step"], Counter())[(r["module_name"], r["scope"], r["micro_step"])] += 1
        assert sorted(per_step, key=int) == [str(s) for s in range(STEPS)]
        first = per_step["0"]
        assert set(first.values()) == {1}, first  # one row per name, scope and micro-batch
        for step, found in per_step.items():
            assert found == first, f"{schedule} rank {rank} step {step}"
        assert {micro for _, _, micro in first} == {str(m) for m in range(M)}
        # torch ran the metadata inference (one more call per chunk at step 0); it left no row
        assert set(result(runs, schedule, rank)["step0_calls"].values()) == {M + 1}


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_rows_are_the_schedules_micro_batches(runs: Path, schedule: str) -> None:
    for rank in range(WORLD):
        expected = result(runs, schedule, rank)["expected"]
        got = {
            f"{r['step']}|{r['module_name']}|{r['scope']}|{r['micro_step']}": [float(r[op]) for op in OPS]
            for r in module_rows(runs, schedule, rank)
        }
        assert expected and set(expected) <= set(got)
        for key, values in expected.items():
            assert got[key] == pytest.approx(values, rel=1e-6, abs=1e-9), key


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_chunks_named_by_global_stage(runs: Path, schedule: str) -> None:
    for rank in range(WORLD):
        stages = stage_indices(schedule, rank)
        for monitor_name in ("module", "weight_grad"):
            rows = rows_of(runs / schedule, monitor_name, rank)
            assert {int(r["vpp_stage"]) for r in rows} == set(stages)
            for r in rows:
                assert r["module_name"].startswith(f"{r['vpp_stage']}:"), r
        names = {r["module_name"] for r in module_rows(runs, schedule, rank)}
        assert {f"{s}:0.weight" for s in stages} == {
            r["module_name"] for r in rows_of(runs / schedule, "weight_grad", rank) if r["module_name"].endswith("0.weight")
        }
        assert {f"{s}:.input.0" for s in stages} <= names


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_unreduced_is_m_times_reduced(runs: Path, schedule: str) -> None:
    """The schedule divides the accumulated gradients by M after the last backward (its
    ``scale_grads``): ``unreduced`` (read before) is M times ``reduced`` (read at the step)."""
    for rank in range(WORLD):
        rows = rows_of(runs / schedule, "weight_grad", rank)
        by_key = {(r["step"], r["module_name"], r["scope"]): r for r in rows}
        pairs = [(r, by_key[(r["step"], r["module_name"], "reduced")]) for r in rows if r["scope"] == "unreduced"]
        assert len(pairs) == STEPS * 2 * len(stage_indices(schedule, rank))  # weight and bias per chunk
        for unreduced, reduced in pairs:
            assert unreduced["micro_step"] == reduced["micro_step"] == str(M)
            for op in OPS:
                assert float(unreduced[op]) == pytest.approx(M * float(reduced[op]), rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_training_bitwise_unchanged_no_hook_left(runs: Path, schedule: str) -> None:
    for rank in range(WORLD):
        found = result(runs, schedule, rank)
        assert found["bitwise"]
        assert found["no_hooks_left"]
        assert not [w for w in found["warnings"] if "trainprobe module" in w], found["warnings"]


def test_plain_submodule_warns_once(runs: Path) -> None:
    for rank in range(WORLD):
        found = result(runs, "unstaged", rank)
        said = [w for w in found["warnings"] if "pipeline stage" in w]
        assert said == [
            f"trainprobe module: model chunk 0 runs as pipeline stage {rank} (torch.distributed.pipelining) but "
            "its rows are named by its chunk index; pass the PipelineStage object(s) to start(model=...) to name "
            "every chunk by its global stage"
        ]
        rows = rows_of(runs / "unstaged", "module", rank)
        assert {r["vpp_stage"] for r in rows} == {"0"} and ".input.0" in {r["module_name"] for r in rows}
