"""trainprobe: see what is going on inside a training run, cheaply enough to leave on.

Public API (also importable under the reference tool's paths, see ``trainprobe.core``):

* :class:`TrainerMonitorV2`: Monitor V2 (module, weight_grad, optimizer, param, cc → CSV).
* :class:`TrainerMon`: Monitor V1 (TrainerMon config dialect; csv, tensorboard, api; alerts; dynamic mode).
* :class:`TrainingMetricsMonitor`: training metrics (loss, lr, grad norms, throughput, per-parameter
  norms, Adam moments, expert load) to TensorBoard, the log and dump_path.
* :class:`PrecisionDebugger` and ``module_dump``/``module_dump_end``/``seed_all``/``random_save``:
  precision data dump.
* :class:`AnomalyStop` / :class:`AnomalyEvent`: what Monitor V2's online rules (its ``anomaly``
  block) raise and report; see docs/acting_on_anomalies.md.
* :func:`rerun_check` (and its :class:`RerunVerdict`): does a training step reproduce bit for
  bit? (a numerical fault, or a transient one of the device).
* :class:`ConfigError`: raised for every invalid config field, naming its JSON path.

``import trainprobe`` is cheap: each name is imported from its module on first use (PEP 562), so
the ``trainprobe`` command and the offline tools never load torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports on first use
    from trainprobe.backends.torch.rerun_check import RerunVerdict, rerun_check
    from trainprobe.dump import PrecisionDebugger, module_dump, module_dump_end, random_save, seed_all
    from trainprobe.engine.anomaly.events import AnomalyEvent, AnomalyStop
    from trainprobe.engine.errors import ConfigError
    from trainprobe.frontdoors.metrics import TrainingMetricsMonitor
    from trainprobe.frontdoors.monitor_v1 import TrainerMon
    from trainprobe.frontdoors.monitor_v2.trainer import TrainerMonitorV2

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "AnomalyEvent": "trainprobe.engine.anomaly.events",
    "AnomalyStop": "trainprobe.engine.anomaly.events",
    "ConfigError": "trainprobe.engine.errors",
    "PrecisionDebugger": "trainprobe.dump",
    "RerunVerdict": "trainprobe.backends.torch.rerun_check",
    "TrainerMon": "trainprobe.frontdoors.monitor_v1",
    "TrainerMonitorV2": "trainprobe.frontdoors.monitor_v2.trainer",
    "TrainingMetricsMonitor": "trainprobe.frontdoors.metrics",
    "module_dump": "trainprobe.dump",
    "module_dump_end": "trainprobe.dump",
    "random_save": "trainprobe.dump",
    "rerun_check": "trainprobe.backends.torch.rerun_check",
    "seed_all": "trainprobe.dump",
}
"""Public name → the module that defines it (imported on first use)."""

__all__ = [
    "AnomalyEvent",
    "AnomalyStop",
    "ConfigError",
    "PrecisionDebugger",
    "RerunVerdict",
    "TrainerMon",
    "TrainerMonitorV2",
    "TrainingMetricsMonitor",
    "__version__",
    "module_dump",
    "module_dump_end",
    "random_save",
    "rerun_check",
    "seed_all",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
