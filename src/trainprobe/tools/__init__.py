"""Tools that turn monitor output (V1 run folders, V2 output_dir) into answers: anomaly analyser,
csv2tensorboard, csv2db and the offline HTML report. Each tool is one module; ``monitor_output``
finds and reads the CSV files they share.

These functions are importable from here (loaded on first use)::

    from trainprobe.tools import analyse, csv2tensorboard_by_step, diagnose, write_report

``trainprobe.tools.diagnose(run, ...)`` works as well (the module is callable).

csv2db is imported from ``trainprobe.core.monitor.csv2db`` (as the reference documents): here the
name ``csv2db`` is its module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.anomaly_analyse import analyse
    from trainprobe.tools.csv2tb import csv2tensorboard_by_step
    from trainprobe.tools.report import write_report

_EXPORTS = {
    "analyse": "trainprobe.tools.anomaly_analyse",
    "csv2tensorboard_by_step": "trainprobe.tools.csv2tb",
    "diagnose": "trainprobe.tools.diagnose",
    "write_report": "trainprobe.tools.report",
}
__all__ = ["analyse", "csv2tensorboard_by_step", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
