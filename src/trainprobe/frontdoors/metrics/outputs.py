"""Where the training metrics go, as sinks of the engine's writer
(:class:`~trainprobe.engine.sinks.background.Writer`, on its background thread).

The training thread hands each recorded step to the writer as one
:class:`~trainprobe.engine.records.StepBatch` of raw named values (:func:`raw_rows`: every value still
on its device, one copy to the host per device, waited for on the writer thread).
:class:`ComposeSink` turns it into the step's named metrics (:class:`~trainprobe.engine.records.ScalarBatch`,
composed by :class:`~trainprobe.frontdoors.metrics.compose.Composer`) and hands them to a
:class:`~trainprobe.engine.sinks.fanout.FanOut` of:

* :class:`~trainprobe.engine.sinks.tensorboard.TensorBoardSink`: ``<tensorboard_dir>/rank_<id>/events.*``
  (scalars; ``-vs-samples`` twins use the samples count as their step; configuration entries
  as TEXT at step 0).
* :class:`LogSink`: the ``trainprobe.metrics`` logger at INFO: one line per recorded step, the
  loss family's summary followed by every other metric whose format includes ``log``.
* :class:`ForwardSink` (in a trainer, without ``tensorboard_dir``): what would go to TensorBoard,
  held for the trainer callback, which hands it to the trainer's own loggers at their cadence.
* :class:`TrainingStateSink`: ``<dump_path>/rank_<id>/training_state.jsonl``, one JSON object per
  recorded step with the local/device norms and losses (one ``write`` per line, so a killed run
  leaves every completed line readable; a write that fails part-way, as on a full disk, is cut
  back to the last whole line). The file is replaced when a run starts from step 0; a run
  resumed after N steps (``initial_step`` = N, or the trainer's global step in the callbacks)
  writes steps N+1, N+2, ...: it keeps the earlier lines of steps up to N and appends after them.

A failing output is reported once and skipped from then on (the fan-out's rule); the others go
on. A resumed run's event files get TensorBoard's ``purge_step`` = N+1, so TensorBoard hides the
earlier run's events of steps after N instead of drawing both runs over each other.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import torch

from trainprobe.backends.torch.device_copy import DeviceCopy
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import error_once
from trainprobe.engine.records import RowBuffer, RowKey, ScalarBatch, StepBatch
from trainprobe.engine.sinks.fanout import FanOut
from trainprobe.engine.sinks.files import append_whole, write_atomically
from trainprobe.engine.sinks.tensorboard import TensorBoardSink
from trainprobe.frontdoors.metrics.compose import Composer, Value
from trainprobe.frontdoors.metrics.config import LOG, TENSORBOARD

metrics_logger = logging.getLogger("trainprobe.metrics")

FORWARD_PREFIX = "trainprobe/"
"""Prefix of the names forwarded to a trainer's loggers (keeps ``trainprobe/loss`` apart from
the trainer's own ``loss``); the per-group learning rates (``lr-...``) keep Lightning's names."""
MONITOR = "metrics"
"""The monitor name of the training metrics' records."""
DUMP_FILE = "training_state.jsonl"
SAMPLES = "samples"
_SCALAR, _LIST = "scalar", "list"


# -- the raw values of a step (training thread) ---------------------------------------------
class RawValues:
    """One step's raw values by name, gathered on the training thread: host numbers, lists of
    host numbers, or tensors (0-d: a number; else flattened), kept on their device as float64.
    At the end of the step the tensors of each device are concatenated and copied to the host
    in one non-blocking copy (:class:`~trainprobe.backends.torch.device_copy.DeviceCopy`): one
    copy per device and step, whatever the number of values, waited for on the writer thread."""

    def __init__(self) -> None:
        self.rows = RowBuffer(DeviceCopy)

    def put(self, key: str, value: float | int | torch.Tensor | list[float]) -> None:
        """Add one value under ``key``."""
        if isinstance(value, torch.Tensor):
            t = value.detach()
            self.rows.add(RowKey(0, key, _SCALAR if t.dim() == 0 else _LIST), t.reshape(-1).to(torch.float64))
        elif isinstance(value, list):
            self.rows.add(RowKey(0, key, _LIST), [float(v) for v in value])
        else:
            self.rows.add(RowKey(0, key, _SCALAR), [float(value)])

    def batch(self, step: int, samples: int | None) -> StepBatch:
        """The values as a batch for the writer; device values start their copy to the host
        (the tensors are copied now, so later in-place changes do not show)."""
        if samples is not None:
            self.put(SAMPLES, samples)
        return self.rows.drain(MONITOR, step)


def raw_values(batch: StepBatch) -> tuple[dict[str, Value], int | None]:
    """``(values by name, samples)`` of a batch made by :meth:`RawValues.batch` (writer thread:
    waits for the device copies)."""
    raw: dict[str, Value] = {}
    for key, row in batch.rows():
        raw[key.name] = row[0] if key.scope == _SCALAR else list(row)
    samples = raw.pop(SAMPLES, None)
    return raw, int(samples) if isinstance(samples, float) else None


# -- sinks (writer thread) ------------------------------------------------------------------
class ComposeSink:
    """Raw values → named metrics → ``outputs`` (a :class:`ScalarBatch` is passed on as it is).
    A step whose metrics cannot be composed is dropped with one error line; training goes on."""

    def __init__(self, composer: Composer, outputs: FanOut) -> None:
        self.composer = composer
        self.outputs = outputs

    def write(self, batch: StepBatch | ScalarBatch) -> None:
        if isinstance(batch, StepBatch):
            try:
                raw, samples = raw_values(batch)
                batch = ScalarBatch(batch.monitor, batch.step, samples, self.composer.compose(raw))
            except Exception:  # noqa: BLE001 - one step lost, training goes on
                error_once(
                    "metrics-compose", f"trainprobe: training metrics of step {batch.step} could not be computed"
                )
                return
        self.outputs.write(batch)

    def close(self, reached: int | None = None) -> None:
        self.outputs.close(reached)


class LogSink:
    """Metrics as log lines of the ``trainprobe.metrics`` logger, one per recorded step."""

    def __init__(self, logger: logging.Logger = metrics_logger) -> None:
        self.logger = logger

    def write(self, batch: ScalarBatch) -> None:
        """One INFO line for the step: ``step:[    2] learning-rate: 0.001, ..., loss: 1.2,
        grad-norm: 0.5, local_norm/layers.0.weight: 0.3, local_loss: 1.2``: the loss family's
        summary, then every other metric whose format includes ``log``, in the order they are
        composed (nothing when the step has neither)."""
        if not self.logger.isEnabledFor(logging.INFO):
            return
        metrics = batch.scalars
        shown = [m for m in metrics if m.summary] + [m for m in metrics if not m.summary and LOG in m.formats]
        if shown:
            self.logger.info("step:[%5d] %s", batch.step, ", ".join(f"{m.tag}: {m.value:.6g}" for m in shown))

    def close(self, reached: int | None = None) -> None:
        """Nothing to close."""


def forwarded_name(tag: str) -> str:
    """The name a metric is forwarded under: ``trainprobe/<tag>``, except the per-group learning
    rates, which keep the names of Lightning's ``LearningRateMonitor`` (``lr-AdamW/pg1``)."""
    return tag if tag.startswith("lr-") else FORWARD_PREFIX + tag


class ForwardSink:
    """The latest recorded step's TensorBoard scalars, by :func:`forwarded_name`, for a trainer
    callback to hand to the trainer's loggers (:meth:`take`). ``-vs-samples`` twins and TEXT
    entries are not kept: a trainer's loggers have one step axis and log hyperparameters
    themselves. Written on the writer thread, taken on the training thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest: tuple[int, dict[str, float]] | None = None

    def write(self, batch: ScalarBatch) -> None:
        values = {forwarded_name(m.tag): m.value for m in batch.scalars if TENSORBOARD in m.formats}
        if values:
            with self._lock:
                self._latest = (batch.step, values)

    def take(self, step: int) -> dict[str, float] | None:
        """The scalars of ``step`` (once), or None when ``step`` is not the latest step written
        (not recorded: ``step_interval``). Older steps are dropped."""
        with self._lock:
            latest, self._latest = self._latest, None
        return latest[1] if latest is not None and latest[0] == step else None

    def close(self, reached: int | None = None) -> None:
        """Nothing to close."""


class TrainingStateSink:
    """``training_state.jsonl`` in one rank's dump folder; whole lines only (see the module
    docstring), a failed write raises its ``OSError`` for the fan-out to report."""

    def __init__(self, rank_dir: Path, resume_at: int | None = None) -> None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        self.path = rank_dir / DUMP_FILE
        if resume_at is not None:
            _keep_lines_before(self.path, resume_at)
        truncate = 0 if resume_at is not None else os.O_TRUNC
        flags = os.O_WRONLY | os.O_CREAT | truncate | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, batch: ScalarBatch) -> None:
        row: dict[str, object] = {m.tag: m.value for m in batch.scalars if m.dump}
        if not row or self._fd is None:
            return
        row = {"step": batch.step, "samples": batch.samples, **row}
        append_whole(self._fd, (json.dumps(row, allow_nan=True) + "\n").encode("utf-8"))

    def close(self, reached: int | None = None) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def tensorboard_sink(log_dir: Path, queue_size: int, resume_at: int | None) -> TensorBoardSink:
    """The metrics' event files (``purge_step`` = ``resume_at``); a missing tensorboard package is
    a ConfigError naming ``tensorboard.tensorboard_dir``."""
    return TensorBoardSink(
        log_dir, max_queue=queue_size, purge_step=resume_at, missing=_missing_tensorboard,
        field="tensorboard.tensorboard_dir",
    )


def _missing_tensorboard(exc: ImportError) -> ConfigError:
    return ConfigError(
        f"tensorboard.tensorboard_dir: writing event files needs the tensorboard package ({exc}); "
        "install it with `pip install trainprobe[tensorboard]` or remove the tensorboard section"
    )


def _keep_lines_before(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically) with its whole JSON lines of steps below ``step``; a torn
    or unreadable line, and every line of step ``step`` or later, is dropped."""
    if not path.is_file():
        return
    kept = []
    with path.open(encoding="utf-8", errors="replace") as handle:
        for line in handle:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] < step:
                kept.append(line if line.endswith("\n") else line + "\n")
    write_atomically(path, "".join(kept))
