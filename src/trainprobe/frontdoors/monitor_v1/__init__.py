"""Monitor V1 (``TrainerMon``): the reference's first monitor API as a front door of the engine."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.frontdoors.monitor_v1.trainer import TrainerMon

_EXPORTS = {
    "TrainerMon": "trainprobe.frontdoors.monitor_v1.trainer",
}
__all__ = ["TrainerMon"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
