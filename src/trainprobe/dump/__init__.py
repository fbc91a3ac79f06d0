"""Precision data dump (``PrecisionDebugger``) and the comparison of two dumps.

Public API: :class:`PrecisionDebugger`, :func:`module_dump`, :func:`module_dump_end`,
:func:`seed_all`, :func:`random_save`; ``trainprobe compare`` (:mod:`trainprobe.dump.cli`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainprobe._lazy import lazy_exports

if TYPE_CHECKING:
    from trainprobe.dump.debugger import PrecisionDebugger, module_dump, module_dump_end
    from trainprobe.dump.seed import random_save, seed_all

_EXPORTS = {
    "PrecisionDebugger": "trainprobe.dump.debugger",
    "module_dump": "trainprobe.dump.debugger",
    "module_dump_end": "trainprobe.dump.debugger",
    "random_save": "trainprobe.dump.seed",
    "seed_all": "trainprobe.dump.seed",
}
__all__ = ["PrecisionDebugger", "module_dump", "module_dump_end", "random_save", "seed_all"]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _EXPORTS)
