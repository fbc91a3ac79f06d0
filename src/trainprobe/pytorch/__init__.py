"""Compatibility path ``trainprobe.pytorch`` (the reference tool's ``msprobe.pytorch``); re-exports only."""

from trainprobe.monitor_v1 import TrainerMon
from trainprobe.pytorch.precision_debugger import (
    PrecisionDebugger,
    module_dump,
    module_dump_end,
    random_save,
    save,
    seed_all,
)

__all__ = ["PrecisionDebugger", "TrainerMon", "module_dump", "module_dump_end", "random_save", "save", "seed_all"]
