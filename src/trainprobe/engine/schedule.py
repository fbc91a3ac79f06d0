"""Which steps are collected, and which output file each collected step goes to.

Pure arithmetic, no torch: the collected steps are
``start_step + i * step_interval`` for ``i = 0, 1, ...`` while the step is below ``stop_step``
(exclusive) and ``i < collect_times``. Output windows (one file per monitor) are
``step_count_per_record`` consecutive *steps* wide, as the reference tool cuts them: Monitor V2
aligns them at ``start_step`` (``[start + k*n, start + k*n + n - 1]``), Monitor V1 at step 0
(``record_origin=0``). A window holds the collected steps that fall in it; with
``step_interval > 1`` that can be fewer than ``step_count_per_record``.

Example:
    >>> s = Schedule(start_step=1, step_interval=2, collect_times=4, step_count_per_record=2)
    >>> [t for t in range(20) if s.collects(t)]
    [1, 3, 5, 7]
    >>> s.window(3)
    (3, 4)
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
    record_origin: int | None = None

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
        """First and last step of the output window holding collected ``step`` (``n`` =
        ``step_count_per_record`` steps from the origin: ``start_step``, or ``record_origin``)."""
        assert self.collects(step), f"step {step} is not collected"
        origin = self.start_step if self.record_origin is None else self.record_origin
        per = self.step_count_per_record
        first = origin + ((step - origin) // per) * per
        return first, first + per - 1

    def file_window(self, step: int, first_step: int = 0) -> tuple[int, int]:
        """First and last step in the name of the file that holds collected ``step``, for a sink
        that sees steps from ``first_step`` on: :meth:`window`, started no earlier than
        ``first_step`` (a session started inside a window names its first file from there, so
        it never shares a name range with the file of the session before it). Every sink
        (CSV, Parquet) names its files by this."""
        first, last = self.window(step)
        return max(first, min(first_step, step)), last

    def step_at(self, index: int) -> int:
        """The step collected at 0-based ``index``."""
        return self.start_step + index * self.step_interval
