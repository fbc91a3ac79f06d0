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

import importlib
from typing import Any

_EXPORTS = {
    "analyse": "trainprobe.tools.anomaly_analyse",
    "csv2tensorboard_by_step": "trainprobe.tools.csv2tb",
    "diagnose": "trainprobe.tools.diagnose",
    "write_report": "trainprobe.tools.report",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainprobe.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
