"""Where metrics go: TensorBoard event files, the log, and the per-rank dump folder.

Each output implements ``write(step, samples, metrics)``, ``text(entries)`` and ``close()``;
they run on the writer thread only.

* :class:`TensorBoardOutput`: ``<tensorboard_dir>/rank_<id>/events.*`` through
  ``torch.utils.tensorboard.SummaryWriter`` (scalars; ``-vs-samples`` twins use the samples
  count as their step; configuration entries as TEXT at step 0). A write error (disk full)
  surfaces as trainprobe's one line, not as a traceback of TensorBoard's writer thread.
* :class:`LogOutput`: the ``trainprobe.metrics`` logger at INFO: one summary line per step for
  the loss family, one line per other metric whose format includes ``log``.
* :class:`DumpOutput`: ``<dump_path>/rank_<id>/training_state.jsonl``, one JSON object per
  recorded step with the local/device norms and losses (one ``write`` per line, so a killed run
  leaves every completed line readable; a write that fails part-way, as on a full disk, is cut
  back to the last whole line). The file is replaced when a run starts from step 0; a run
  resumed after N steps (``initial_step`` = N, or the trainer's global step in the callbacks)
  writes steps N+1, N+2, ...: it keeps the earlier lines of steps up to N and appends after them.

A resumed run's event files get TensorBoard's ``purge_step`` = N+1, so TensorBoard hides the
earlier run's events of steps after N instead of drawing both runs over each other.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainprobe.errors import ConfigError
from trainprobe.metrics.compose import Metric
from trainprobe.metrics.config import LOG, TENSORBOARD
from trainprobe.sinks.fast_crc import use_fast_crc
from trainprobe.sinks.files import append_whole, write_atomically
from trainprobe.sinks.tensorboard import quiet_writer_thread

metrics_logger = logging.getLogger("trainprobe.metrics")

DUMP_FILE = "training_state.jsonl"
SAMPLES_SUFFIX = "-vs-samples"


def summary_writer_class() -> type:
    """``torch.utils.tensorboard.SummaryWriter``, or a ConfigError saying what to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # pragma: no cover - tensorboard is an extra
        raise ConfigError(
            f"tensorboard.tensorboard_dir: writing event files needs the tensorboard package ({exc}); "
            "install it with `pip install trainprobe[tensorboard]` or remove the tensorboard section"
        ) from None
    return SummaryWriter


class TensorBoardOutput:
    """Scalars and text into one rank's event files."""

    def __init__(self, log_dir: Path, queue_size: int, resume_at: int | None = None) -> None:
        writer_class = summary_writer_class()
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = writer_class(log_dir=str(log_dir), max_queue=queue_size, purge_step=resume_at)
        use_fast_crc(self._writer)
        quiet_writer_thread(self._writer)
        from tensorboard.compat.proto.summary_pb2 import Summary  # present: the writer class loaded

        self._summary = Summary

    def write(self, step: int, samples: int | None, metrics: Sequence[Metric]) -> None:
        """One event per x value: every scalar of the step in one summary at ``step``, their
        ``-vs-samples`` twins in one at ``samples`` (what ``add_scalar`` writes, one record per
        step instead of one per scalar: the writer thread's cost per step)."""
        Summary = self._summary  # noqa: N806 - the protobuf class
        by_step: list[Any] = []
        by_samples: list[Any] = []
        for m in metrics:
            if TENSORBOARD in m.formats:
                by_step.append(Summary.Value(tag=m.tag, simple_value=float(m.value)))
                if m.vs_samples and samples is not None:
                    by_samples.append(Summary.Value(tag=m.tag + SAMPLES_SUFFIX, simple_value=float(m.value)))
        file_writer = self._writer._get_file_writer()  # torch's FileWriter: add_summary(summary, step)
        if by_step:
            file_writer.add_summary(Summary(value=by_step), step)
        if by_samples:
            file_writer.add_summary(Summary(value=by_samples), samples)

    def text(self, entries: Sequence[tuple[str, str]]) -> None:
        for tag, body in entries:
            self._writer.add_text(tag, body, 0)

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class LogOutput:
    """Metrics as log lines of the ``trainprobe.metrics`` logger."""

    def __init__(self, logger: logging.Logger = metrics_logger) -> None:
        self.logger = logger

    def write(self, step: int, samples: int | None, metrics: Sequence[Metric]) -> None:
        if not self.logger.isEnabledFor(logging.INFO):
            return
        summary = [f"{m.tag}: {m.value:.6g}" for m in metrics if m.summary]
        if summary:
            self.logger.info("step:[%5d] %s", step, ", ".join(summary))
        for m in metrics:
            if not m.summary and LOG in m.formats:
                self.logger.info("step:[%5d] %s: %.6g", step, m.tag, m.value)

    def text(self, entries: Sequence[tuple[str, str]]) -> None:
        """Configuration text is for TensorBoard only."""

    def close(self) -> None:
        """Nothing to close."""


class DumpOutput:
    """``training_state.jsonl`` in one rank's dump folder; whole lines only (see the module
    docstring), a failed write raises its ``OSError`` for the writer to report."""

    def __init__(self, rank_dir: Path, resume_at: int | None = None) -> None:
        rank_dir.mkdir(parents=True, exist_ok=True)
        self.path = rank_dir / DUMP_FILE
        if resume_at is not None:
            _keep_lines_before(self.path, resume_at)
        truncate = 0 if resume_at is not None else os.O_TRUNC
        flags = os.O_WRONLY | os.O_CREAT | truncate | os.O_APPEND | getattr(os, "O_CLOEXEC", 0)
        self._fd: int | None = os.open(self.path, flags, 0o644)

    def write(self, step: int, samples: int | None, metrics: Sequence[Metric]) -> None:
        row: dict[str, object] = {m.tag: m.value for m in metrics if m.dump}
        if not row or self._fd is None:
            return
        row = {"step": step, "samples": samples, **row}
        append_whole(self._fd, (json.dumps(row, allow_nan=True) + "\n").encode("utf-8"))

    def text(self, entries: Sequence[tuple[str, str]]) -> None:
        """Configuration text is for TensorBoard only."""

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


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
