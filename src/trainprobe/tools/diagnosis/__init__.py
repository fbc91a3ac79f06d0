"""``trainprobe diagnose``: the first anomaly of a run (``answer``), its command line (``cli``), the
spike rules applied to every series (``spikes``) and the online events shown beside it
(``online``).

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.diagnosis.answer import Diagnosis, diagnose, diagnosis_summary
    from trainprobe.tools.diagnosis.cli import add_parser

_EXPORTS = {
    "Diagnosis": "trainprobe.tools.diagnosis.answer",
    "add_parser": "trainprobe.tools.diagnosis.cli",
    "diagnose": "trainprobe.tools.diagnosis.answer",
    "diagnosis_summary": "trainprobe.tools.diagnosis.answer",
}
__all__ = ["Diagnosis", "add_parser", "diagnose", "diagnosis_summary"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
