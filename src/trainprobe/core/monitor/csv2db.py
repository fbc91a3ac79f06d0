"""Compatibility path of the reference tool's ``msprobe.core.monitor.csv2db``.

``csv2db(CSV2DBConfig(monitor_path, time_start=None, time_end=None, process_num=1,
data_type_list=None, step_partition=500, output_dirpath=None))`` writes ``monitor_metrics.db``;
see :mod:`trainprobe.tools.exports.sqlite` and docs/csv2db.md.
"""

from __future__ import annotations

from trainprobe.tools.exports.sqlite import CSV2DBConfig, CSV2DBResult, csv2db

__all__ = ["CSV2DBConfig", "CSV2DBResult", "csv2db"]
