"""Compatibility import path of the reference tool (``msprobe.pytorch``): a re-export."""

from trainprobe.dump import PrecisionDebugger, module_dump, module_dump_end, random_save, seed_all

__all__ = ["PrecisionDebugger", "module_dump", "module_dump_end", "random_save", "seed_all"]
