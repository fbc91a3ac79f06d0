"""Documented import path of Monitor V1: re-exports :mod:`trainprobe.frontdoors.monitor_v1`."""

from trainprobe.frontdoors.monitor_v1 import __all__, __dir__, __getattr__  # noqa: F401
