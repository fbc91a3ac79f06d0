"""Hardening of the monitors' writers: CSV cells are exactly ``csv.writer``'s for any name, a
full disk leaves ``training_state.jsonl`` with whole lines only, and a TensorBoard write error is
reported in trainprobe's one line, never as a traceback from TensorBoard's writer thread.

Faults: ``/dev/full`` (ENOSPC from the kernel) where a file can be pointed at it, else
``os.write`` patched to write part of its data and then fail as a full disk does."""

from __future__ import annotations

import csv
import errno
import io
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainprobe.engine.log
from conftest import write_config
from test_metrics_helpers import TINY, tiny_gpt
from trainprobe import TrainerMonitorV2
from trainprobe.demo.gpt import synthetic_batches
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

HOSTILE = ["a,b", 'q"q', "a\nb", "a\rb", "a\r\nb", "a\u2028b", "a\u2029b", "a\x85b", "a\x0cb", "a\x0bb",
           "a\x1cb", "nul\x00x", "%d%s%%", " lead", "trail ", "tab\tx", "é😀", '"', ",", "x\r", "\ny"]  # fmt: skip
"""Names that the csv module quotes, and names it leaves alone but other line splitters break on."""


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())


def csv_writer_line(cells: list[object]) -> str:
    """What ``csv.writer`` (default dialect, QUOTE_MINIMAL) writes, ending in ``\\n``."""
    buf = io.StringIO()
    csv.writer(buf).writerow(cells)
    return buf.getvalue().removesuffix("\r\n") + "\n"


def read_rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as fh:
        return list(csv.reader(fh))


# -- CSV names ----------------------------------------------------------------------------
def test_hostile_module_names_round_trip_through_csv_reader(tmp_path: Path) -> None:
    """A real model whose module names hold commas, quotes, line breaks of every kind, NUL and
    a lone surrogate: every name is read back exactly by ``csv.reader`` (the surrogate, which
    UTF-8 cannot encode, as its escape), and no monitor is lost."""
    names = [*HOSTILE, "sur\udc80x"]
    torch.manual_seed(0)
    model = nn.Sequential()
    for n in names:
        model.add_module(n, nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(tmp_path / "out"),
           "monitors": {"weight_grad": {"enabled": True, "ops": ["min", "norm", "nans"]},
                        "module": {"enabled": True, "ops": ["max"]}}}  # fmt: skip
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    mon.start(model=model, optimizer=opt)
    for _ in range(2):
        model(torch.randn(2, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
    mon.stop()

    expected = {n.encode("utf-8", "backslashreplace").decode("utf-8") for n in names}
    files = sorted((tmp_path / "out" / "rank_0").glob("*.csv"))
    assert [f.name for f in files] == ["module_step0-0.csv", "module_step1-1.csv",
                                       "weight_grad_step0-0.csv", "weight_grad_step1-1.csv"]  # fmt: skip
    for f in files:
        rows = read_rows(f)
        width = len(rows[0])
        assert all(len(r) == width for r in rows), f.name
        got = {r[2].rsplit(".", 1)[0] for r in rows[1:]}
        if f.name.startswith("module"):
            got = {g.rsplit(".", 1)[0] for g in got} - {""}  # "<name>.input.0" → "<name>"; the root's name is ""
        assert got == expected, f.name


def hostile_name(rng: random.Random) -> str:
    parts = [*HOSTILE, "a", "Z", "0", ".", "_", "é", "\udc80", "\ud800"]
    return "".join(rng.choice(parts) for _ in range(rng.randint(1, 6)))


def test_fuzz_csv_lines_are_csv_writer_bytes_and_names_round_trip(tmp_path: Path) -> None:
    rng = random.Random(1124)
    layout = TableLayout(with_micro_step=True, ops=("min", "max", "nans"))
    keys = [RowKey(rng.randint(0, 3), hostile_name(rng), hostile_name(rng), rng.choice([None, 0, 2]))
            for _ in range(400)]  # fmt: skip
    values = [[rng.uniform(-1, 1), rng.choice([1.5, float("inf"), float("nan")]), float(rng.randint(0, 9))]
              for _ in keys]  # fmt: skip
    sink = CsvSink(tmp_path, Schedule(start_step=0, step_interval=1, step_count_per_record=1),
                   {"module": layout})  # fmt: skip
    sink.write(StepBatch("module", 7, keys, dict(enumerate(values))))
    sink.close()

    raw = (tmp_path / "module_step7-7.csv").read_bytes()
    expected = csv_writer_line(layout.header) + "".join(csv_writer_line(layout.cells(k, 7, v))
                                                        for k, v in zip(keys, values))  # fmt: skip
    assert raw == expected.encode("utf-8", "backslashreplace")
    rows = read_rows(tmp_path / "module_step7-7.csv")[1:]
    assert len(rows) == len(keys)
    for row, key in zip(rows, keys):
        assert row[2] == key.name.encode("utf-8", "backslashreplace").decode("utf-8")
        assert row[3] == key.scope.encode("utf-8", "backslashreplace").decode("utf-8")


# -- training_state.jsonl -------------------------------------------------------------------
def test_full_disk_leaves_whole_lines_in_training_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The third line's write stores half its bytes, then the disk is full: the file is cut
    back to the two whole lines, the output is disabled with one line, training goes on."""
    real_write = os.write
    calls = {"n": 0}

    def fills_up(fd: int, data: Any) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith("training_state.jsonl"):
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] < 3:
            return real_write(fd, data)
        if calls["n"] == 3:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", fills_up)
    model, opt = tiny_gpt()
    cfg = {"monitor_config": {"monitor_on": True, "dump_path": str(tmp_path / "dump"),
                              "local_loss_format": "log", "device_local_norm_format": "log"}}  # fmt: skip
    mon = TrainingMetricsMonitor(cfg, model=model, optimizer=opt)
    batches = synthetic_batches(TINY, 2)
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        for _ in range(5):
            loss = model.loss(next(batches))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mon.step(loss=loss)
        mon.close()

    assert calls["n"] == 4
    text = (tmp_path / "dump" / "rank_0" / "training_state.jsonl").read_text()
    lines = text.splitlines()
    assert text.endswith("\n") and len(lines) == 2
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "TrainingStateSink failed" in errors[0].getMessage()
    assert "No space left on device" in errors[0].getMessage() and not errors[0].exc_info


# -- TensorBoard ----------------------------------------------------------------------------
_TB_SCRIPT = textwrap.dedent(
    """
    import logging, os, sys, time
    from pathlib import Path
    import torch
    from trainprobe.frontdoors.metrics import TrainingMetricsMonitor
    from trainprobe.engine.records import RowKey, StepBatch
    from trainprobe.engine.sinks.background import Writer
    from trainprobe.engine.sinks.fanout import FanOut
    from trainprobe.engine.sinks.tensorboard import TensorBoardSink
    sys.path.insert(0, sys.argv[2])
    from test_metrics_helpers import TINY, tiny_gpt
    from trainprobe.demo.gpt import synthetic_batches

    logging.basicConfig(format="%(message)s")
    base = Path(sys.argv[1])

    def fill_disk(folder):
        # every event file from now on is /dev/full: each write gets ENOSPC from the kernel
        for f in folder.glob("events.out.tfevents.*"):
            f.unlink()
            f.symlink_to("/dev/full")

    # Monitor V1's path: TensorBoardSink behind FanOut and the writer thread
    sink = TensorBoardSink(base / "v1", {"m": ("min",)}, lambda m, k: m, lambda t, k, op: f"{k.name}/{op}")
    writer = Writer(FanOut([sink]), background=True, on_error=lambda m, e: None)
    writer.submit(StepBatch("m", 0, [RowKey(0, "w", "s")], {0: [1.0]}))
    writer.flush(); sink.flush()
    fill_disk(base / "v1")
    for step in range(1, 4):
        writer.submit(StepBatch("m", step, [RowKey(0, "w", "s")], {0: [float(step)]}))
        writer.flush()
        time.sleep(0.1)
    writer.close(3)

    # the training metrics' TensorBoard output, on a real model
    model, opt = tiny_gpt()
    cfg = {"monitor_config": {"monitor_on": True, "dump_path": str(base / "dump"),
                              "local_loss_format": "tensorboard"},
           "tensorboard": {"tensorboard_dir": str(base / "tb"), "tensorboard_queue_size": 1}}
    mon = TrainingMetricsMonitor(cfg, model=model, optimizer=opt)
    batches = synthetic_batches(TINY, 2)
    for step in range(4):
        if step == 1:
            mon._writer.flush()
            fill_disk(base / "tb" / "rank_0")
        loss = model.loss(next(batches)); loss.backward(); opt.step(); opt.zero_grad()
        mon.step(loss=loss)
        time.sleep(0.1)
    mon.close()
    print("TRAINING-DONE")
    """
)


def test_tensorboard_disk_fault_is_one_trainprobe_line_and_no_thread_traceback(tmp_path: Path) -> None:
    script = tmp_path / "tb_fault.py"
    script.write_text(_TB_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(trainprobe.engine.log.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run([sys.executable, str(script), str(tmp_path), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "TRAINING-DONE" in done.stdout
    assert "Exception in thread" not in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    # the metrics' own ``log`` output ("step:[ ...] ...") shows too, at INFO: only trainprobe's fault lines count here
    lines = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("step:")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("trainprobe: the TensorBoardSink output failed and is disabled")
    assert lines[1].startswith("trainprobe: TensorBoardSink failed and is disabled; the other outputs continue")
    assert all("No space left on device" in line for line in lines)


_FSIZE_SCRIPT = textwrap.dedent(
    """
    import json, resource, signal, sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[2])
    from test_metrics_helpers import TINY, tiny_gpt
    from trainprobe.demo.gpt import synthetic_batches
    from trainprobe.frontdoors.metrics import TrainingMetricsMonitor

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    model, opt = tiny_gpt()
    cfg = {"monitor_config": {"monitor_on": True, "dump_path": sys.argv[1], "local_loss_format": "log",
                              "device_local_norm_format": "log"}}
    mon = TrainingMetricsMonitor(cfg, model=model, optimizer=opt)
    path = Path(sys.argv[1]) / "rank_0" / "training_state.jsonl"
    batches = synthetic_batches(TINY, 2)
    for step in range(6):
        if step == 2:
            mon._writer.flush()
            size = path.stat().st_size
            line = size // 2
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + line + line // 2, resource.RLIM_INFINITY))
        loss = model.loss(next(batches)); loss.backward(); opt.step(); opt.zero_grad()
        mon.step(loss=loss)
    mon.close()
    print("TRAINING-DONE")
    """
)


def test_a_real_partial_write_is_cut_back_to_whole_lines(tmp_path: Path) -> None:
    """The kernel's own short write: a file size limit (RLIMIT_FSIZE) lets the fourth line in
    only partly, then refuses (EFBIG), as a disk that fills up mid-line does."""
    script = tmp_path / "fsize.py"
    script.write_text(_FSIZE_SCRIPT)
    dump = tmp_path / "dump"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(trainprobe.engine.log.__file__).parents[1]),
                                                        os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run([sys.executable, str(script), str(dump), str(Path(__file__).parent)],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0 and "TRAINING-DONE" in done.stdout, done.stderr
    text = (dump / "rank_0" / "training_state.jsonl").read_text()
    assert text.endswith("\n")
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3]
    assert "File too large" in done.stderr and "Traceback" not in done.stderr


def test_a_full_disk_under_monitor_v2_is_one_line_and_whole_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_write = os.write
    calls = {"n": 0}

    def fills_up(fd: int, data: Any) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".csv"):
            return real_write(fd, data)
        calls["n"] += 1
        if calls["n"] <= 2:  # the header and step 0's rows
            return real_write(fd, data)
        if calls["n"] == 3:
            return real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", fills_up)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = {"output_dir": str(tmp_path / "out"), "step_count_per_record": 4,
           "monitors": {"weight_grad": {"enabled": True, "ops": ["min", "norm"]}}}  # fmt: skip
    mon = TrainerMonitorV2(write_config(tmp_path, cfg))
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        mon.start(model=model, optimizer=opt)
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
        mon.stop()
    assert calls["n"] == 4
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "No space left on device" in errors[0].getMessage()
    assert not errors[0].exc_info
    (csv_file,) = (tmp_path / "out" / "rank_0").glob("weight_grad_step0-*.csv")
    rows = read_rows(csv_file)
    assert csv_file.read_text().endswith("\n") and {r[1] for r in rows[1:]} == {"0"}
