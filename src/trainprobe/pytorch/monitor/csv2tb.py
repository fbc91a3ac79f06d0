"""Compatibility import path: ``from trainprobe.pytorch.monitor.csv2tb import csv2tensorboard_by_step``
(the reference's ``msprobe.pytorch.monitor.csv2tb``); a re-export of
:func:`trainprobe.tools.exports.tensorboard.csv2tensorboard_by_step`."""

from trainprobe.tools.exports.tensorboard import csv2tensorboard_by_step

__all__ = ["csv2tensorboard_by_step"]
