"""Config dialects: each reads a user's file into frozen, validated dataclasses."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.config.monitor_v2 import MonitorV2Config, load_monitor_v2_config

_EXPORTS = {
    "MonitorV2Config": "trainprobe.config.monitor_v2",
    "load_monitor_v2_config": "trainprobe.config.monitor_v2",
}
__all__ = ["MonitorV2Config", "load_monitor_v2_config"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
