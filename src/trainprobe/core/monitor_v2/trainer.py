"""Compatibility path: ``from trainprobe.core.monitor_v2.trainer import TrainerMonitorV2``."""

from trainprobe.trainer_v2 import TrainerMonitorV2

__all__ = ["TrainerMonitorV2"]
