"""Compatibility import path of the reference tool (``msprobe.pytorch.monitor``)."""
