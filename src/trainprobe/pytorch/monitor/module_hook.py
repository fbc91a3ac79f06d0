"""Compatibility import path: ``from trainprobe.pytorch.monitor.module_hook import TrainerMon``
(the reference's ``msprobe.pytorch.monitor.module_hook``); a re-export of
:class:`trainprobe.frontdoors.monitor_v1.TrainerMon`."""

from trainprobe.frontdoors.monitor_v1 import TrainerMon

__all__ = ["TrainerMon"]
