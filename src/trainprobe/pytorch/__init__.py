"""Compatibility path ``trainprobe.pytorch`` (the reference tool's ``msprobe.pytorch``); re-exports only."""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.frontdoors.monitor_v1 import TrainerMon
    from trainprobe.pytorch.precision_debugger import (
        PrecisionDebugger,
        module_dump,
        module_dump_end,
        random_save,
        save,
        seed_all,
    )

_EXPORTS = {
    "PrecisionDebugger": "trainprobe.pytorch.precision_debugger",
    "TrainerMon": "trainprobe.frontdoors.monitor_v1",
    "module_dump": "trainprobe.pytorch.precision_debugger",
    "module_dump_end": "trainprobe.pytorch.precision_debugger",
    "random_save": "trainprobe.pytorch.precision_debugger",
    "save": "trainprobe.pytorch.precision_debugger",
    "seed_all": "trainprobe.pytorch.precision_debugger",
}
__all__ = ["PrecisionDebugger", "TrainerMon", "module_dump", "module_dump_end", "random_save", "save", "seed_all"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
