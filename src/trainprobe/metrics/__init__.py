"""Training metrics (MindSpore Transformers' monitor, for PyTorch): loss, learning rate,
gradient norms, throughput, per-parameter norms, Adam moments, expert load, to TensorBoard,
the log and a per-rank dump folder.

* :class:`TrainingMetricsMonitor`: the front door (``step()`` once per optimizer step).
* :func:`load_training_metrics_config`: the ``monitor_config`` / ``tensorboard`` dialect.
"""

from trainprobe.metrics.config import TrainingMetricsConfig, load_training_metrics_config
from trainprobe.metrics.monitor import TrainingMetricsMonitor

__all__ = ["TrainingMetricsConfig", "TrainingMetricsMonitor", "load_training_metrics_config"]
