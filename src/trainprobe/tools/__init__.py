"""Tools that turn monitor output (V1 run folders, V2 output_dir) into answers. The packages follow
the data flow: ``runs`` finds and describes a run's files and reads them in batches, ``sql`` builds
every piece of SQL, ``engines`` runs it (DuckDB locked to the run, or Spark), ``query`` is the public
query layer, then one package per answer: ``diagnosis`` (``trainprobe diagnose``), ``rundiff``
(``trainprobe diff``), ``reporting`` (``trainprobe report``), ``anomalies``
(``trainprobe anomaly-analyse``) and ``exports`` (csv2db, csv2tensorboard).

These functions are importable from here (loaded on first use)::

    from trainprobe.tools import analyse, csv2tensorboard_by_step, diagnose, diff, write_report

csv2db is imported from ``trainprobe.core.monitor.csv2db`` (as the reference documents) or from
``trainprobe.tools.exports``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.anomalies.analyser import analyse
    from trainprobe.tools.diagnosis.answer import diagnose
    from trainprobe.tools.exports.tensorboard import csv2tensorboard_by_step
    from trainprobe.tools.reporting.report import write_report
    from trainprobe.tools.rundiff.answer import diff

_EXPORTS = {
    "analyse": "trainprobe.tools.anomalies.analyser",
    "csv2tensorboard_by_step": "trainprobe.tools.exports.tensorboard",
    "diagnose": "trainprobe.tools.diagnosis.answer",
    "diff": "trainprobe.tools.rundiff.answer",
    "write_report": "trainprobe.tools.reporting.report",
}
__all__ = ["analyse", "csv2tensorboard_by_step", "diagnose", "diff", "write_report"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
