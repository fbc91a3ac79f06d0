"""Statistics: what each op means (``ops``) and how tensors become numbers (``torch_stats``)."""

from trainprobe.stats.ops import ALL_OPS, DEFAULT_EPS, DEFAULT_OPS, parse_ops

__all__ = ["ALL_OPS", "DEFAULT_EPS", "DEFAULT_OPS", "parse_ops"]
