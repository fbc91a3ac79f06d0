"""Monitor V1 (``TrainerMon``): the reference's first monitor API as a front door of the engine."""

from trainprobe.monitor_v1.trainer import TrainerMon

__all__ = ["TrainerMon"]
