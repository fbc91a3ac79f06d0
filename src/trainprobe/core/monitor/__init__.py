"""Compatibility path: ``trainprobe.core.monitor`` (the reference tool's ``msprobe.core.monitor``: monitor output tools)."""
