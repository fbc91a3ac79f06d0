"""Compatibility path: ``from trainprobe.core.monitor_v2.trainer import TrainerMonitorV2``."""

from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

__all__ = ["TrainerMonitorV2"]
