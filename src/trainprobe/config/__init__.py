"""Config dialects: each reads a user's file into frozen, validated dataclasses."""

from trainprobe.config.monitor_v2 import MonitorV2Config, load_monitor_v2_config

__all__ = ["MonitorV2Config", "load_monitor_v2_config"]
