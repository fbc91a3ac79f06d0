"""Tools that turn monitor output (V1 run folders, V2 output_dir) into answers: anomaly analyser,
csv2tensorboard, csv2db and the offline HTML report. Each tool is one module; they read monitor
output through the query layer (``query``), ``monitor_layout`` names its layouts and selects
files by V1 timestamp and data type.

These functions are importable from here (loaded on first use)::

    from trainprobe.tools import analyse, csv2tensorboard_by_step, diagnose, diff, write_report

``trainprobe.tools.diagnose(run, ...)`` and ``trainprobe.tools.diff(baseline, candidate, ...)``
work as well once their modules are imported (the modules are callable).

csv2db is imported from ``trainprobe.core.monitor.csv2db`` (as the reference documents): here the
name ``csv2db`` is its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.anomaly_analyse import analyse
    from trainprobe.tools.csv2tb import csv2tensorboard_by_step
    from trainprobe.tools.diagnose import diagnose
    from trainprobe.tools.diff import diff
    from trainprobe.tools.report import write_report

_EXPORTS = {
    "analyse": "trainprobe.tools.anomaly_analyse",
    "csv2tensorboard_by_step": "trainprobe.tools.csv2tb",
    "diagnose": "trainprobe.tools.diagnose",
    "diff": "trainprobe.tools.diff",
    "write_report": "trainprobe.tools.report",
}
__all__ = ["analyse", "csv2tensorboard_by_step", "diagnose", "diff", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
