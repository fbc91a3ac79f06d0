"""Compatibility import paths of the reference tool (``msprobe.core...``); re-exports only."""
