"""Moved to :mod:`trainprobe.engine.execution_order` (the online anomaly rules order rows as the
tools do); this name is kept while every importer moves over."""

from trainprobe.engine.execution_order import *  # noqa: F403
