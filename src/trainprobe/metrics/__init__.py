"""Documented import path of the training metrics: re-exports :mod:`trainprobe.frontdoors.metrics`."""

from trainprobe.frontdoors.metrics import __all__, __dir__, __getattr__  # noqa: F401
