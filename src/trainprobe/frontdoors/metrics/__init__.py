"""Training metrics (MindSpore Transformers' monitor, for PyTorch): loss, learning rate,
gradient norms, throughput, per-parameter norms, Adam moments, expert load, to TensorBoard,
the log and a per-rank dump folder.

* :class:`TrainingMetricsMonitor`: the front door (``step()`` once per optimizer step).
* :func:`load_training_metrics_config`: the ``monitor_config`` / ``tensorboard`` dialect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.frontdoors.metrics.config import TrainingMetricsConfig, load_training_metrics_config
    from trainprobe.frontdoors.metrics.monitor import TrainingMetricsMonitor

_EXPORTS = {
    "TrainingMetricsConfig": "trainprobe.frontdoors.metrics.config",
    "TrainingMetricsMonitor": "trainprobe.frontdoors.metrics.monitor",
    "load_training_metrics_config": "trainprobe.frontdoors.metrics.config",
}
__all__ = ["TrainingMetricsConfig", "TrainingMetricsMonitor", "load_training_metrics_config"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
