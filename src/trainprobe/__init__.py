"""trainprobe: see what is going on inside a training run, cheaply enough to leave on.

Public API (also importable under the reference tool's paths, see ``trainprobe.core``):

* :class:`TrainerMonitorV2`: Monitor V2 (module, weight_grad, optimizer, param, cc → CSV).
* :class:`ConfigError`: raised for every invalid config field, naming its JSON path.
"""

from trainprobe.errors import ConfigError
from trainprobe.trainer_v2 import TrainerMonitorV2

__version__ = "0.1.0"
__all__ = ["ConfigError", "TrainerMonitorV2", "__version__"]
