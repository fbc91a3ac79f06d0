"""Monitor V2: the ``TrainerMonitorV2`` front door (:mod:`.trainer`) and its config dialect
(:mod:`.config`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.frontdoors.monitor_v2.config import MonitorV2Config, load_monitor_v2_config
    from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

_EXPORTS = {
    "MonitorV2Config": "trainprobe.frontdoors.monitor_v2.config",
    "TrainerMonitorV2": "trainprobe.frontdoors.monitor_v2.trainer",
    "load_monitor_v2_config": "trainprobe.frontdoors.monitor_v2.config",
}
__all__ = ["MonitorV2Config", "TrainerMonitorV2", "load_monitor_v2_config"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
