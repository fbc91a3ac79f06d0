"""Compatibility path: ``trainprobe.core.monitor_v2``."""
