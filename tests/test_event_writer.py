"""The one TensorBoard event writer (``sinks/events.py``) and the records the sinks share:
one event per batch, the events ``SummaryWriter`` would write otherwise, named scalars of
several lengths through one device copy, and the shared fault guard."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader  # noqa: E402
from tensorboard.compat.proto.event_pb2 import Event  # noqa: E402

from trainprobe.engine.errors import ConfigError  # noqa: E402
from trainprobe.engine.guard import Fuses, guarded  # noqa: E402
from trainprobe.engine.records import NamedScalar, RowBuffer, RowKey, ScalarBatch, StepBatch  # noqa: E402
from trainprobe.engine.sinks.events import EventWriter  # noqa: E402
from trainprobe.engine.sinks.tensorboard import TensorBoardSink  # noqa: E402


def events(folder: Path) -> list[Event]:
    """Every event of the folder's event files, as written (no data migration)."""
    found = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        found.extend(Event.FromString(raw) for raw in RawEventFileLoader(str(path)).Load())
    return found


def without_time(event: Event) -> Event:
    copy = Event()
    copy.CopyFrom(event)
    copy.wall_time = 0
    return copy


def test_a_step_batch_is_one_event_with_every_value(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path, {"m": ("min", "max")}, lambda m, k: m, lambda t, k, op: f"{k.name}/{op}")
    keys = [RowKey(0, "w", "param"), RowKey(0, "b", "param")]
    sink.write(StepBatch("m", 3, keys, {0: [1.0, 2.0], 1: [-1.5, 0.25]}))
    sink.close()
    written = [e for e in events(tmp_path) if e.HasField("summary")]
    assert len(written) == 1 and written[0].step == 3
    assert [(v.tag, v.simple_value) for v in written[0].summary.value] == [
        ("w/min", 1.0), ("w/max", 2.0), ("b/min", -1.5), ("b/max", 0.25)
    ]  # fmt: skip


def test_named_scalars_one_event_per_axis_and_text(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    tb, log = frozenset({"tensorboard"}), frozenset({"log"})
    sink.write(ScalarBatch("metrics", 0, None, [], texts=(("seed", "1"),)))
    scalars = [NamedScalar("loss", 2.5, tb, vs_samples=True), NamedScalar("lr", 0.1, tb), NamedScalar("x", 1.0, log)]
    sink.write(ScalarBatch("metrics", 7, 28, scalars))
    sink.close()
    written = [e for e in events(tmp_path) if e.HasField("summary")]
    assert [(e.step, [v.tag for v in e.summary.value]) for e in written] == [
        (0, ["seed/text_summary"]), (7, ["loss", "lr"]), (28, ["loss-vs-samples"])
    ]  # fmt: skip


def test_same_events_as_summary_writer(tmp_path: Path) -> None:
    """purge_step markers, a scalar and a text: what ``SummaryWriter`` writes, but the wall time."""
    from torch.utils.tensorboard import SummaryWriter

    theirs = SummaryWriter(str(tmp_path / "theirs"), purge_step=4)
    theirs.add_scalar("a", 1.25, 4)
    theirs.add_text("t", "body", 0)
    theirs.close()
    ours = EventWriter(tmp_path / "ours", purge_step=4, missing=ConfigError)
    ours.write(4, [ours.scalar("a", 1.25)])
    ours.write(0, [ours.text("t", "body")])
    ours.close()
    assert [without_time(e) for e in events(tmp_path / "ours")] == [
        without_time(e) for e in events(tmp_path / "theirs")
    ]


def test_missing_tensorboard_is_the_callers_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.event_file_writer", None)
    with pytest.raises(ConfigError, match="field: needs tensorboard"):
        EventWriter(tmp_path, missing=lambda exc: ConfigError("field: needs tensorboard"))


def test_rows_of_several_lengths_share_one_copy() -> None:
    rows = RowBuffer()
    rows.add(RowKey(0, "scalar", "s"), torch.tensor([2.0], dtype=torch.float64))
    rows.add(RowKey(0, "vector", "s"), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64))
    rows.add(RowKey(0, "host", "s"), [4.0, 5.0])
    batch = rows.drain("metrics", 1)
    assert len(batch._copies) == 1
    assert [(k.name, v) for k, v in batch.rows()] == [
        ("scalar", [2.0]),
        ("vector", [1.0, 2.0, 3.0]),
        ("host", [4.0, 5.0]),
    ]


def test_the_shared_guard(caplog: pytest.LogCaptureFixture) -> None:
    failures: list[Exception] = []
    off = {"flag": False}

    def boom() -> int:
        raise RuntimeError("bad")

    assert guarded(boom, off=lambda: off["flag"], fail=failures.append)() is None
    assert [str(e) for e in failures] == ["bad"]
    off["flag"] = True
    assert guarded(boom, off=lambda: off["flag"], fail=failures.append)() is None and len(failures) == 1
    switches = Fuses("test-guard")
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        for _ in range(3):
            switches.run("part", "the part", boom)
    assert not switches.is_on("part") and switches.is_on("other")
    assert [r.getMessage() for r in caplog.records] == ["trainprobe: gathering the part failed; it is turned off"]
