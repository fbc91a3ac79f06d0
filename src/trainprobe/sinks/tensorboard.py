"""TensorBoard output: every statistic is a scalar event ``add_scalar(tag, value, step)``.

Event files are written by ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard``
package: ``pip install trainprobe[tensorboard]``) into ``log_dir``. The tag of each value comes
from ``tag_of(table, key, op)``, so each dialect names its tags itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from trainprobe.errors import ConfigError
from trainprobe.records import RowKey, StepBatch


def _summary_writer_class() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:  # tensorboard not installed
        raise ConfigError(
            f"format: 'tensorboard' needs the tensorboard package ({exc}); install it with "
            "`pip install tensorboard` (or trainprobe[tensorboard]), or use format 'csv'"
        ) from None
    return SummaryWriter


class TensorBoardSink:
    """Scalars into TensorBoard event files.

    Args:
        log_dir: folder of the event files.
        ops: monitor or table → op names (value order), looked up with ``table_of``.
        table_of: the table of a row.
        tag_of: the tag of ``(table, key, op)``.

    Raises:
        ConfigError: the tensorboard package is missing (at construction, never in training).
    """

    def __init__(
        self,
        log_dir: Path,
        ops: Mapping[str, tuple[str, ...]],
        table_of: Callable[[str, RowKey], str],
        tag_of: Callable[[str, RowKey, str], str],
    ) -> None:
        writer_class = _summary_writer_class()
        log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = writer_class(log_dir=str(log_dir))
        self.ops = dict(ops)
        self.table_of = table_of
        self.tag_of = tag_of

    def write(self, batch: StepBatch) -> None:
        for key, values in batch.rows():
            table = self.table_of(batch.monitor, key)
            for op, value in zip(self.ops[table], values):
                self._writer.add_scalar(self.tag_of(table, key, op), value, batch.step)

    def flush(self) -> None:
        """Push pending events to disk."""
        self._writer.flush()

    def close(self, reached: int | None = None) -> None:
        self._writer.flush()
        self._writer.close()
