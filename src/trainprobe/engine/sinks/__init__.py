"""Sinks write records; :class:`~trainprobe.engine.sinks.background.Writer` keeps IO off the training thread."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.engine.sinks.background import Writer
    from trainprobe.engine.sinks.csv_sink import CsvSink, TableLayout

_EXPORTS = {
    "CsvSink": "trainprobe.engine.sinks.csv_sink",
    "TableLayout": "trainprobe.engine.sinks.csv_sink",
    "Writer": "trainprobe.engine.sinks.background",
}
__all__ = ["CsvSink", "TableLayout", "Writer"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
