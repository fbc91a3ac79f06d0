"""``trainprobe anomaly-analyse``: Monitor V1's anomaly events (``events``) read from every rank
(``read``), kept and ordered (``order``), written and printed (``output``) by the analyser
(``analyser``).

The names below are loaded on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.tools.anomalies.analyser import add_parser, analyse

_EXPORTS = {
    "add_parser": "trainprobe.tools.anomalies.analyser",
    "analyse": "trainprobe.tools.anomalies.analyser",
}
__all__ = ["add_parser", "analyse"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
