"""The front doors: each is a config dialect plus the assembly of probes, sinks and a
:class:`~trainprobe.engine.session.Session` that a user's calls drive.

* :mod:`trainprobe.frontdoors.monitor_v2`: ``TrainerMonitorV2`` (per-rank CSV);
* :mod:`trainprobe.frontdoors.monitor_v1`: ``TrainerMon`` (the V1 dialect: csv, tensorboard, api,
  alerts, dynamic mode);
* :mod:`trainprobe.frontdoors.metrics`: ``TrainingMetricsMonitor`` (named scalars to TensorBoard
  and the log).

Users import them from :mod:`trainprobe` (or the reference tool's paths under
``trainprobe.core`` / ``trainprobe.pytorch``).
"""
