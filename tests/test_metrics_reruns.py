"""A training-metrics run into folders an earlier or a concurrent run used (docs/training_metrics.md,
"Re-running into the same folders"): a run from step 0 into a ``tensorboard_dir`` holding an earlier
run's event files moves that run aside (``tb.1/rank_0``) unless asked to overwrite (or resuming);
two live runs on one ``dump_path`` are refused instead of interleaving ``training_state.jsonl``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from test_metrics_helpers import TINY, read_events, tiny_gpt
from trainprobe.demo.gpt import synthetic_batches
from trainprobe.engine.errors import ConfigError
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor


def config(tmp_path: Path, *, tensorboard: bool = True, **tb: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "dump"), "local_loss_format": "log"}
    }
    if tensorboard:
        cfg["tensorboard"] = {"tensorboard_dir": str(tmp_path / "tb"), **tb}
    return cfg


def run(cfg: dict[str, Any], steps: int, **kwargs: Any) -> None:
    model, opt = tiny_gpt()
    batches = synthetic_batches(TINY, 2)
    with TrainingMetricsMonitor(cfg, model=model, optimizer=opt, **kwargs) as mon:
        for _ in range(steps):
            loss = model.loss(next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad()
            mon.step(loss=loss)


def loss_steps(tmp_path: Path, tb: str = "tb") -> list[int]:
    """The loss steps TensorBoard reads from every event file of rank 0, in order."""
    return [e.step for e in read_events(tmp_path / tb / "rank_0").Scalars("loss")]


def state_steps(tmp_path: Path, dump: str = "dump") -> list[int]:
    lines = (tmp_path / dump / "rank_0" / "training_state.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def test_a_second_run_from_step_0_into_one_tensorboard_dir_moves_the_first_aside(tmp_path: Path) -> None:
    run(config(tmp_path), 3)
    run(config(tmp_path), 2)
    assert loss_steps(tmp_path, "tb.1") == [1, 2, 3]  # TensorBoard reads each run as one
    assert loss_steps(tmp_path) == [1, 2]
    assert state_steps(tmp_path, "dump.1") == [1, 2, 3]
    assert state_steps(tmp_path) == [1, 2]


@pytest.mark.parametrize("how", ["argument", "config", "environment"])
def test_overwrite_replaces_the_earlier_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    run(config(tmp_path), 3)
    (tmp_path / "tb" / "rank_0" / "notes.txt").write_text("kept")
    if how == "environment":
        monkeypatch.setenv("TRAINPROBE_OVERWRITE", "1")
    run(config(tmp_path, **({"overwrite": True} if how == "config" else {})), 2, overwrite=how == "argument")
    assert loss_steps(tmp_path) == [1, 2]
    assert len(list((tmp_path / "tb" / "rank_0").glob("events.out.tfevents.*"))) == 1
    assert (tmp_path / "tb" / "rank_0" / "notes.txt").read_text() == "kept"  # only event files go
    assert state_steps(tmp_path) == [1, 2]


def test_overwrite_when_resuming_drops_every_earlier_line(tmp_path: Path) -> None:
    run(config(tmp_path), 3)
    run(config(tmp_path), 2, initial_step=2, overwrite=True)
    assert loss_steps(tmp_path) == [3, 4]
    assert state_steps(tmp_path) == [3, 4]


def test_a_resumed_run_continues_without_overwrite(tmp_path: Path) -> None:
    run(config(tmp_path), 3)
    time.sleep(1.1)  # event files are named by the second they start in, and read in name order
    run(config(tmp_path), 2, initial_step=2)  # purge_step 3: TensorBoard hides the first run's step 3
    assert loss_steps(tmp_path) == [1, 2, 3, 4]
    assert state_steps(tmp_path) == [1, 2, 3, 4]


def test_without_tensorboard_a_rerun_starts_rank_x_empty_and_keeps_the_earlier(tmp_path: Path) -> None:
    """The reference clears ``rank_x``: the new run's file is alone there too, the earlier one kept."""
    run(config(tmp_path, tensorboard=False), 3)
    run(config(tmp_path, tensorboard=False), 2)
    assert state_steps(tmp_path) == [1, 2]
    assert state_steps(tmp_path, "dump.1") == [1, 2, 3]


def test_bad_overwrite_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tensorboard\.overwrite: must be true or false"):
        TrainingMetricsMonitor(config(tmp_path, overwrite="yes"))
    with pytest.raises(ConfigError, match=r"overwrite: must be True or False, got 1"):
        TrainingMetricsMonitor(config(tmp_path), overwrite=1)  # type: ignore[arg-type]


def test_two_live_monitors_in_one_process_share_no_dump_path(tmp_path: Path) -> None:
    cfg = config(tmp_path, tensorboard=False)
    first = TrainingMetricsMonitor(cfg)
    try:
        with pytest.raises(ConfigError, match=r"monitor_config\.dump_path: .*rank_0' is being written by another run"):
            TrainingMetricsMonitor(cfg)
    finally:
        first.close()
    TrainingMetricsMonitor(cfg).close()  # closed: the folder is free again


def test_one_folder_for_both_outputs_is_not_a_conflict(tmp_path: Path) -> None:
    cfg = config(tmp_path)
    cfg["monitor_config"]["dump_path"] = cfg["tensorboard"]["tensorboard_dir"]
    run(cfg, 2)
    assert (tmp_path / "tb" / "rank_0" / "training_state.jsonl").is_file()


HOLD = textwrap.dedent(
    """
    import sys, time
    from trainprobe.frontdoors.metrics import TrainingMetricsMonitor
    mon = TrainingMetricsMonitor(
        {"monitor_config": {"monitor_on": True, "dump_path": sys.argv[1], "local_loss_format": "log"}}
    )
    for step in range(1, 4):
        mon.step(loss=float(step))
    mon.flush()  # steps 1-3 are written: the kill below must not lose them
    print("ready", flush=True)
    for step in range(4, 100000):
        mon.step(loss=float(step))
        time.sleep(0.01)
    """
)


def test_a_second_process_on_one_dump_path_is_refused_and_a_dead_ones_folder_is_free(tmp_path: Path) -> None:
    """Two real processes: while the first writes, the second is refused naming dump_path (before,
    their lines interleaved and some were lost); once the first is killed (SIGKILL: no cleanup
    at all) the folder can be used again."""
    script = tmp_path / "hold.py"
    script.write_text(HOLD)
    dump = tmp_path / "dump"
    proc = subprocess.Popen([sys.executable, str(script), str(dump)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        cfg = config(tmp_path, tensorboard=False)
        with pytest.raises(ConfigError, match=r"monitor_config\.dump_path: .*dump/rank_0' is being written by another"):
            TrainingMetricsMonitor(cfg)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    text = (dump / "rank_0" / "training_state.jsonl").read_text()
    # docs/training_metrics.md: "a killed run leaves whole lines": every line written before the
    # kill is there, whole (the file ends with a line break) and in step order from 1
    assert text.endswith("\n")
    killed = [json.loads(line) for line in text.splitlines()]
    assert [row["step"] for row in killed] == list(range(1, len(killed) + 1)) and len(killed) >= 3
    assert [row["local_loss"] for row in killed[:3]] == [1.0, 2.0, 3.0]
    run(config(tmp_path, tensorboard=False), 3)  # the dead run's lock went with it
    assert state_steps(tmp_path) == [1, 2, 3]


def test_a_forked_child_does_not_keep_the_folder_locked(tmp_path: Path) -> None:
    """A DataLoader worker forked while the run holds its lock must not keep holding it after the
    run closed (a second run in the same process would be refused while the worker lives)."""
    cfg = config(tmp_path, tensorboard=False)
    first = TrainingMetricsMonitor(cfg)
    read, write = os.pipe()
    ready_read, ready_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: says it is running, waits until the parent is done, exits without cleanup
        os.close(write)
        os.write(ready_write, b"r")
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    try:
        assert os.read(ready_read, 1) == b"r"  # the fork hooks have run in the child
        first.close()
        TrainingMetricsMonitor(cfg).close()  # the live child holds no copy of the lock
    finally:
        os.write(write, b"x")
        for fd in (write, ready_read, ready_write):
            os.close(fd)
        os.waitpid(pid, 0)
