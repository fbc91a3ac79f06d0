"""Rows, batches, the CSV sink and the background writer, without a model."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from conftest import read_csv
from trainprobe.backends.torch.stats import TensorStats
from trainprobe.engine.records import RowBuffer, RowKey, StepBatch
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.background import Writer
from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout

OPS = ("min", "max", "mean", "norm", "nans", "zeros")


def test_device_strategy_matches_host_strategy():
    """The accelerator code path (values kept as tensors) agrees with the CPU path."""
    stats = TensorStats(OPS, eps=1e-3)
    for t in (torch.randn(1000), torch.tensor([1.0, float("nan"), -2.0, 0.0]), torch.randn(3, 4, dtype=torch.bfloat16)):
        x = t.float() if t.dtype == torch.bfloat16 else t
        device_row = stats._device_row(x).tolist()
        host_row = stats.row(x)
        assert device_row == pytest.approx(host_row, rel=1e-6, nan_ok=True)


def test_row_buffer_keeps_order_across_host_and_device_values():
    buf = RowBuffer()
    keys = [RowKey(0, f"t{i}", "s", i) for i in range(4)]
    buf.add(keys[0], [1.0, 2.0])
    buf.add(keys[1], torch.tensor([3.0, 4.0], dtype=torch.float64))
    buf.extend(keys[2:], [[5.0, 6.0], torch.tensor([7.0, 8.0], dtype=torch.float64)])
    batch = buf.drain("m", 3)
    assert len(buf) == 0 and batch.step == 3
    assert [(k.name, v) for k, v in batch.rows()] == [
        ("t0", [1.0, 2.0]),
        ("t1", [3.0, 4.0]),
        ("t2", [5.0, 6.0]),
        ("t3", [7.0, 8.0]),
    ]


def test_row_buffer_is_thread_safe():
    buf = RowBuffer()

    def add_many(tag: int) -> None:
        for i in range(500):
            buf.add(RowKey(0, f"{tag}.{i}", "s"), [float(i)])

    threads = [threading.Thread(target=add_many, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(buf.drain("m", 0).rows()) == 2000


def batch_of(monitor: str, step: int, rows: list[tuple[str, list[float]]], micro: int | None = None):
    buf = RowBuffer()
    for name, values in rows:
        buf.add(RowKey(0, name, "scope", micro), values)
    return buf.drain(monitor, step)


def test_csv_sink_windows_header_and_precision(tmp_path):
    schedule = Schedule(step_count_per_record=2)
    sink = CsvSink(tmp_path, schedule, {"wg": TableLayout(True, ("min", "nans")), "p": TableLayout(False, ("norm",))})
    value = 0.1 + 1e-17
    for step in range(3):
        sink.write(batch_of("wg", step, [("a", [value, 2.0])], micro=1))
        sink.write(batch_of("p", step, [("a", [1 / 3])]))
    sink.close(reached=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "p_step0-1.csv",
        "p_step2-3.csv",
        "wg_step0-1.csv",
        "wg_step2-3.csv",
    ]
    header, rows = read_csv(tmp_path / "wg_step0-1.csv")
    assert header == ["vpp_stage", "step", "module_name", "scope", "micro_step", "min", "nans"]
    assert [r["step"] for r in rows] == ["0", "1"]
    assert float(rows[0]["min"]) == value and rows[0]["nans"] == "2"
    header, rows = read_csv(tmp_path / "p_step2-3.csv")
    assert header == ["vpp_stage", "step", "module_name", "scope", "norm"]
    assert float(rows[0]["norm"]) == 1 / 3


def test_writer_reports_a_failing_monitor_once_and_keeps_the_others(tmp_path):
    errors: list[tuple[str, str]] = []
    sink = CsvSink(tmp_path, Schedule(), {"bad": TableLayout(False, ("max",)), "good": TableLayout(False, ("max",))})
    (tmp_path / "bad_step0-0.csv").mkdir()
    writer = Writer(sink, background=True, on_error=lambda m, e: errors.append((m, type(e).__name__)))
    for step in range(3):
        writer.submit(batch_of("bad", step, [("x", [1.0])]))
        writer.submit(batch_of("good", step, [("x", [1.0])]))
    writer.close(reached=2)
    assert errors == [("bad", "IsADirectoryError")]
    assert sorted(p.name for p in tmp_path.glob("good*")) == [
        "good_step0-0.csv",
        "good_step1-1.csv",
        "good_step2-2.csv",
    ]


@pytest.mark.parametrize(
    "layout",
    [
        TableLayout(True, ("min", "max", "mean", "norm", "nans", "zeros")),
        TableLayout(False, ("min", "nans"), ("vpp_stage", "name", "step"), 3),
        TableLayout(False, ("max", "nans"), ("vpp_stage", "name")),
    ],
)
def test_fast_csv_text_is_what_the_csv_module_writes(layout):
    """TableLayout.text (templates cached per key) gives the csv module's bytes for awkward
    names, NaN counts, integers, infinities and signed zeros, on first and repeated use."""
    import csv
    import io

    samples = [
        ("a,b%d", "x", None, [1.0, 2.5, float("nan"), 1e-300, 3.0, 0.5]),
        ('q"t', "y\nz", 2, [float("inf"), -0.0, 1 / 3, 2.0, float("nan"), 0.0]),
        (" sp ", "", 0, [1, 2, 3, 4, 5, 6]),
        ("%s%%", "p", 3, [1.5, 2.0, 3.0, 4.0, 5.0, 6.0]),
        ("n", "p", 3, [1.5, float("nan"), 3.0, 4.0, float("nan"), 6.0]),
        ("np", "p", 4, [np.float64(0.1), np.float32(2.5), 3.0, 4.0, 5.0, 6.0]),  # NumPy scalars: not %r
    ]
    rows = [(RowKey(0, name, scope, micro), values[: len(layout.ops)]) for name, scope, micro, values in samples]
    for step in (7, 8):
        expected = io.StringIO()
        writer = csv.writer(expected, lineterminator="\n")
        for key, values in rows:
            writer.writerow(layout.cells(key, step, values))
        assert layout.text(rows, step) == expected.getvalue()


@pytest.mark.parametrize("ndigits", [None, 3])
def test_csv_sink_batches_are_what_the_csv_module_writes(tmp_path, ndigits):
    """A batch with the keys of the table's last batch is written from one template of the whole
    batch: the file still holds the csv module's bytes, for awkward names (``%``, quotes, NUL),
    a step whose row has a NaN count (written row by row), and a batch whose keys change."""
    import csv
    import io

    layout = TableLayout(True, ("min", "max", "nans"), ndigits=ndigits)
    keys = [RowKey(0, "a,b%d", "s", 1), RowKey(1, 'q"t', "s%s", 0), RowKey(0, "plain", "s", 2)]
    steps = [
        (0, keys, [[1.0, 2.5, 0.0], [-0.0, float("inf"), 3.0], [1 / 3, 1e-300, 0.0]]),
        (1, keys, [[0.1, 2.0, 0.0], [1e300, -1.5, 1.0], [2 / 3, 7.0, 0.0]]),
        (2, keys, [[0.1, 2.0, float("nan")], [float("nan"), -1.5, 1.0], [2 / 3, 7.0, 0.0]]),
        (3, keys[:2] + [RowKey(0, "nul\x00name", "s", 2)], [[0.5, 1.0, 0.0], [1.0, 2.0, 0.0], [3.0, 4.0, 2.0]]),
        (4, keys, [[0.25, 0.5, 0.0], [1.0, 2.0, 0.0], [3.0, 4.0, 0.0]]),
    ]
    sink = CsvSink(tmp_path, Schedule(step_count_per_record=5), {"m": layout})
    expected = io.StringIO()
    writer = csv.writer(expected, lineterminator="\n")
    writer.writerow(layout.header)
    for step, step_keys, values in steps:
        buffer = RowBuffer()
        buffer.extend(step_keys, [list(v) for v in values])
        sink.write(buffer.drain("m", step))
        for key, row in zip(step_keys, values):
            writer.writerow(layout.cells(key, step, row))
    sink.close(reached=4)
    (written,) = tmp_path.glob("m_step*.csv")
    assert written.read_text(encoding="utf-8") == expected.getvalue()


FILE_LIMIT_SCRIPT = r"""
import resource, signal, sys
from pathlib import Path
from trainprobe.engine.records import RowBuffer, RowKey
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.background import Writer
from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout

signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead
out = Path(sys.argv[1])
errors = []
sink = CsvSink(out, Schedule(step_count_per_record=1000), {"m": TableLayout(False, ("min", "max", "norm"))})
writer = Writer(sink, background=True, on_error=lambda m, e: errors.append((m, type(e).__name__)))
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, resource.RLIM_INFINITY))
for step in range(200):
    buf = RowBuffer()
    for i in range(7):
        buf.add(RowKey(0, f"layer{i}.weight", ""), [0.1 * step, 1.0 / 3.0, float(i)])
    writer.submit(buf.drain("m", step))
writer.close(reached=199)
print(errors)
"""


def test_a_write_cut_short_by_a_full_disk_leaves_whole_rows(tmp_path):
    """A write failing part-way (here the file size limit, as a full disk would) is cut back:
    the monitor is reported once and disabled, and its file still ends with a whole row."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FILE_LIMIT_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('m', 'OSError')]"
    (path,) = tmp_path.glob("m_step*.csv")
    text = path.read_text()
    assert 0 < len(text) <= 5000 and text.endswith("\n")
    header, rows = read_csv(path)
    assert header == ["vpp_stage", "step", "module_name", "scope", "min", "max", "norm"]
    assert rows and all(len(r) == len(header) for r in rows)


class _SlowSink:
    """Records what it writes; each write waits until the test releases it."""

    def __init__(self) -> None:
        self.written: list[int] = []
        self.release = threading.Event()
        self.closed = False

    def write(self, batch: StepBatch) -> None:
        self.release.wait(10)
        self.written.append(batch.step)

    def close(self, reached: int | None = None) -> None:
        self.closed = True


def test_writer_budget_by_cost_makes_the_caller_wait_for_room():
    """``cost`` weighs each batch against ``max_pending``: a batch that does not fit waits until
    the writer has room; one larger than the whole budget still goes when nothing else waits."""
    sink = _SlowSink()
    writer = Writer(sink, background=True, on_error=lambda m, e: None, max_pending=10, cost=lambda b: b.step)
    writer.submit(batch_of("m", 6, [("x", [1.0])]))  # running (blocked in the sink)
    submitted = threading.Event()

    def second() -> None:
        writer.submit(batch_of("m", 5, [("x", [1.0])]))  # 6 + 5 > 10: waits for room
        submitted.set()

    threading.Thread(target=second, daemon=True).start()
    assert not submitted.wait(0.3)
    sink.release.set()
    assert submitted.wait(10)
    writer.submit(batch_of("m", 50, [("x", [1.0])]))  # over the budget on its own: goes when alone
    writer.flush()
    assert sink.written == [6, 5, 50]
    writer.close()
    assert sink.closed


def test_writer_thread_ends_when_idle_and_the_next_batch_starts_another():
    sink = _SlowSink()
    sink.release.set()
    writer = Writer(sink, background=True, on_error=lambda m, e: None, idle_exit_s=0.05)
    assert writer._thread is None  # started by the first batch, not before
    writer.submit(batch_of("m", 0, [("x", [1.0])]))
    first = writer._thread
    assert first is not None
    writer.flush()
    first.join(5)
    assert not first.is_alive() and writer._thread is None
    writer.submit(batch_of("m", 1, [("x", [1.0])]))
    writer.close()
    assert sink.written == [0, 1] and sink.closed
