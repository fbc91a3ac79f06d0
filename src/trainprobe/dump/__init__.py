"""Precision data dump (``PrecisionDebugger``) and the comparison of two dumps.

Public API: :class:`PrecisionDebugger`, :func:`module_dump`, :func:`module_dump_end`,
:func:`seed_all`, :func:`random_save`; ``trainprobe compare`` (:mod:`trainprobe.dump.cli`).
"""

from trainprobe.dump.debugger import PrecisionDebugger, module_dump, module_dump_end
from trainprobe.dump.seed import random_save, seed_all

__all__ = ["PrecisionDebugger", "module_dump", "module_dump_end", "random_save", "seed_all"]
