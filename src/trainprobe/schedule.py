"""Which steps are collected, and which output file each collected step goes to.

Pure arithmetic, no torch: the collected steps are
``start_step + i * step_interval`` for ``i = 0, 1, ...`` while the step is below ``stop_step``
(exclusive) and ``i < collect_times``. Collected steps are grouped ``step_count_per_record`` at a
time into one output window (one file per monitor), named by its first and last step.

Example:
    >>> s = Schedule(start_step=2, step_interval=3, collect_times=4, step_count_per_record=2)
    >>> [t for t in range(20) if s.collects(t)]
    [2, 5, 8, 11]
    >>> s.window(8)
    (8, 11)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """Collection schedule; ``stop_step`` and ``collect_times`` may be None (unbounded)."""

    start_step: int = 0
    stop_step: int | None = None
    step_interval: int = 1
    collect_times: int | None = None
    step_count_per_record: int = 1

    def __post_init__(self) -> None:
        assert self.start_step >= 0 and self.step_interval >= 1 and self.step_count_per_record >= 1
        assert self.stop_step is None or self.stop_step >= self.start_step
        assert self.collect_times is None or self.collect_times >= 1

    @property
    def total(self) -> int | None:
        """How many steps will be collected in all (None: unbounded)."""
        bounds = []
        if self.collect_times is not None:
            bounds.append(self.collect_times)
        if self.stop_step is not None:
            span = self.stop_step - self.start_step
            bounds.append(-(-span // self.step_interval))
        return min(bounds) if bounds else None

    def index(self, step: int) -> int | None:
        """The 0-based collection index of ``step``, or None if it is not collected."""
        offset = step - self.start_step
        if offset < 0 or offset % self.step_interval:
            return None
        i = offset // self.step_interval
        total = self.total
        return i if total is None or i < total else None

    def collects(self, step: int) -> bool:
        """Whether ``step`` is collected."""
        return self.index(step) is not None

    def finished(self, step: int) -> bool:
        """Whether no step at or after ``step`` will be collected."""
        total = self.total
        if total is None:
            return False
        last = self.start_step + (total - 1) * self.step_interval
        return total == 0 or step > last

    def window(self, step: int) -> tuple[int, int]:
        """First and last collected step of the output window holding collected ``step``."""
        i = self.index(step)
        assert i is not None, f"step {step} is not collected"
        per = self.step_count_per_record
        first = (i // per) * per
        last = first + per - 1
        total = self.total
        if total is not None:
            last = min(last, total - 1)
        return self.step_at(first), self.step_at(last)

    def step_at(self, index: int) -> int:
        """The step collected at 0-based ``index``."""
        return self.start_step + index * self.step_interval
