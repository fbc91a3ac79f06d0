"""Sinks write records; :class:`~trainprobe.sinks.background.Writer` keeps IO off the training thread."""

from trainprobe.sinks.background import Writer
from trainprobe.sinks.csv_sink import CsvSink, TableLayout

__all__ = ["CsvSink", "TableLayout", "Writer"]
