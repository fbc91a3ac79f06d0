"""trainprobe: see what is going on inside a training run, cheaply enough to leave on.

Public API (also importable under the reference tool's paths, see ``trainprobe.core``):

* :class:`TrainerMonitorV2`: Monitor V2 (module, weight_grad, optimizer, param, cc → CSV).
* :class:`TrainerMon`: Monitor V1 (TrainerMon config dialect; csv, tensorboard, api; alerts; dynamic mode).
* :class:`TrainingMetricsMonitor`: training metrics (loss, lr, grad norms, throughput, per-parameter
  norms, Adam moments, expert load) to TensorBoard, the log and dump_path.
* :class:`PrecisionDebugger` and ``module_dump``/``module_dump_end``/``seed_all``/``random_save``:
  precision data dump.
* :class:`ConfigError`: raised for every invalid config field, naming its JSON path.
"""

from trainprobe.dump import PrecisionDebugger, module_dump, module_dump_end, random_save, seed_all
from trainprobe.errors import ConfigError
from trainprobe.metrics import TrainingMetricsMonitor
from trainprobe.monitor_v1 import TrainerMon
from trainprobe.trainer_v2 import TrainerMonitorV2

__version__ = "0.1.0"
__all__ = [
    "ConfigError",
    "PrecisionDebugger",
    "TrainerMon",
    "TrainerMonitorV2",
    "TrainingMetricsMonitor",
    "__version__",
    "module_dump",
    "module_dump_end",
    "random_save",
    "seed_all",
]
