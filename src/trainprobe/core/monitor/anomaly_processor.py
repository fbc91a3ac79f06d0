"""Compatibility path of the reference tool's ``msprobe.core.monitor.anomaly_processor``.

``python -m trainprobe.core.monitor.anomaly_processor -d DIR [-o OUT] [-k TOPK] [-s STEP_LIST]``
is the same as ``trainprobe anomaly-analyse ...``; see :mod:`trainprobe.tools.anomalies.analyser`.
"""

from __future__ import annotations

import sys

from trainprobe.tools.anomalies.analyser import (
    AnalyseResult,
    AnomalyEvent,
    analyse,
    execution_key,
    load_anomalies,
    main,
    order_events,
    parse_step_list,
    phase_of,
)

__all__ = [
    "AnalyseResult",
    "AnomalyEvent",
    "analyse",
    "execution_key",
    "load_anomalies",
    "main",
    "order_events",
    "parse_step_list",
    "phase_of",
]

if __name__ == "__main__":
    sys.exit(main())
