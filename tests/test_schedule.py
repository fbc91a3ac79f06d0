"""Schedule arithmetic checked against a brute-force enumeration of the collected steps."""

from __future__ import annotations

import itertools

import pytest

from trainprobe.engine.schedule import Schedule

HORIZON = 80  # every bounded schedule below ends well before this step


def brute_collected(start: int, stop: int | None, interval: int, times: int | None, horizon: int) -> list[int]:
    """Collected steps in ``range(horizon)``, found by looking at every step (no closed forms)."""
    steps = []
    for t in range(horizon):
        if t < start or (t - start) % interval != 0:
            continue
        if stop is not None and t >= stop:
            continue
        if times is not None and len(steps) >= times:
            continue
        steps.append(t)
    return steps


def check_against_brute_force(start: int, stop: int | None, interval: int, times: int | None, per: int) -> None:
    s = Schedule(
        start_step=start, stop_step=stop, step_interval=interval, collect_times=times, step_count_per_record=per
    )
    collected = brute_collected(start, stop, interval, times, HORIZON)
    bounded = stop is not None or times is not None
    label = f"start={start} stop={stop} interval={interval} times={times} per={per}"

    # total
    if bounded:
        assert s.total == len(collected), label
    else:
        assert s.total is None, label

    # collects / index / step_at
    position = {t: i for i, t in enumerate(collected)}
    for t in range(HORIZON):
        assert s.collects(t) == (t in position), (label, t)
        assert s.index(t) == position.get(t), (label, t)
    for i, t in enumerate(collected):
        assert s.step_at(i) == t, (label, i)

    # finished: no collected step at or after t
    last = collected[-1] if collected else -1
    for t in range(HORIZON):
        expected = bounded and t > last
        assert s.finished(t) == expected, (label, t)

    # window: blocks of ``per`` consecutive steps counted from start_step (the reference's
    # writer), whatever step_interval and the schedule's end; found by walking the steps
    for t in collected:
        first = start
        while first + per <= t:
            first += per
        assert s.window(t) == (first, first + per - 1), (label, t)


@pytest.mark.parametrize("interval", [1, 2, 3, 5])
@pytest.mark.parametrize("per", [1, 2, 3, 4])
def test_matches_brute_force(interval: int, per: int) -> None:
    for start in range(0, 6):
        for stop in [None, *range(start, start + 14)]:
            for times in [None, 1, 2, 3, 4, 7]:
                check_against_brute_force(start, stop, interval, times, per)


def test_unbounded_schedule() -> None:
    s = Schedule(start_step=3, step_interval=4, step_count_per_record=3)
    assert s.total is None
    assert not any(s.finished(t) for t in range(0, 10_000, 97))
    assert s.collects(3) and s.collects(3 + 4 * 1000) and not s.collects(4 + 4 * 1000)
    assert s.index(3 + 4 * 1000) == 1000
    # windows keep their full width (3 steps from start_step) arbitrarily far away
    assert s.window(3 + 4 * 1000) == (4002, 4004)
    assert s.window(3 + 4 * 999) == (3999, 4001)


def test_default_schedule_collects_every_step_one_per_file() -> None:
    s = Schedule()
    assert s.total is None
    assert all(s.collects(t) for t in range(100))
    assert [s.index(t) for t in range(5)] == [0, 1, 2, 3, 4]
    assert all(s.window(t) == (t, t) for t in range(100))
    assert not s.finished(10**9)


def test_docstring_example() -> None:
    s = Schedule(start_step=2, step_interval=3, collect_times=4, step_count_per_record=2)
    assert [t for t in range(20) if s.collects(t)] == [2, 5, 8, 11]
    assert s.window(8) == (8, 9)
    assert s.window(2) == (2, 3) and s.window(5) == (4, 5)
    assert s.total == 4
    assert not s.finished(11) and s.finished(12)


def test_stop_step_is_exclusive() -> None:
    s = Schedule(start_step=0, stop_step=10, step_interval=5)
    assert [t for t in range(20) if s.collects(t)] == [0, 5]
    assert s.total == 2
    s = Schedule(start_step=0, stop_step=11, step_interval=5)
    assert [t for t in range(20) if s.collects(t)] == [0, 5, 10]
    assert s.total == 3


def test_stop_and_collect_times_smaller_bound_wins() -> None:
    by_times = Schedule(start_step=1, stop_step=100, collect_times=3)
    assert by_times.total == 3
    assert [t for t in range(100) if by_times.collects(t)] == [1, 2, 3]
    by_stop = Schedule(start_step=1, stop_step=3, collect_times=30)
    assert by_stop.total == 2
    assert [t for t in range(100) if by_stop.collects(t)] == [1, 2]


def test_last_window_is_not_truncated_by_bound() -> None:
    """As the reference names them: a window is step_count_per_record steps wide even when the
    schedule ends inside it (the sink may rename a window that a run leaves early)."""
    s = Schedule(start_step=0, step_interval=2, collect_times=5, step_count_per_record=2)
    assert [s.window(t) for t in (0, 2, 4, 6, 8)] == [(0, 1), (2, 3), (4, 5), (6, 7), (8, 9)]
    s = Schedule(start_step=0, stop_step=9, step_interval=2, step_count_per_record=4)
    assert s.window(8) == (8, 11) and s.window(0) == (0, 3) and s.window(2) == (0, 3)


def test_empty_schedule_when_stop_equals_start() -> None:
    s = Schedule(start_step=5, stop_step=5)
    assert s.total == 0
    assert not any(s.collects(t) for t in range(20))
    assert all(s.finished(t) for t in range(20))


def test_before_start_is_not_finished() -> None:
    s = Schedule(start_step=10, collect_times=1)
    assert not s.finished(0) and not s.finished(10) and s.finished(11)
    assert s.index(9) is None and s.index(-1) is None


def test_window_of_uncollected_step_asserts() -> None:
    s = Schedule(start_step=2, step_interval=2)
    with pytest.raises(AssertionError, match="not collected"):
        s.window(3)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"start_step": -1},
        {"step_interval": 0},
        {"step_count_per_record": 0},
        {"collect_times": 0},
        {"start_step": 5, "stop_step": 4},
    ],
)
def test_invalid_schedule_rejected(kwargs: dict) -> None:
    with pytest.raises(AssertionError):
        Schedule(**kwargs)


def test_schedule_is_frozen_and_hashable() -> None:
    s = Schedule(start_step=1)
    with pytest.raises(AttributeError):
        s.start_step = 2  # type: ignore[misc]
    assert hash(s) == hash(Schedule(start_step=1))


@pytest.mark.parametrize("start,interval,per", list(itertools.product([0, 7], [1, 3], [1, 5])))
def test_windows_partition_the_collected_steps(start: int, interval: int, per: int) -> None:
    s = Schedule(start_step=start, step_interval=interval, collect_times=13, step_count_per_record=per)
    collected = [t for t in range(start + 13 * interval + 5) if s.collects(t)]
    windows = sorted({s.window(t) for t in collected})
    # consecutive, disjoint, covering every collected step exactly once
    covered = [t for first, last in windows for t in collected if first <= t <= last]
    assert covered == collected
    assert all(len([t for t in collected if first <= t <= last]) <= per for first, last in windows)


def test_window_with_step_interval_follows_reference() -> None:
    """start 1, interval 2, 2 steps per record: the reference writes step1-2, 3-4, 5-6 (one
    collected step each), not step1-3, 5-5."""
    s = Schedule(start_step=1, step_interval=2, collect_times=3, step_count_per_record=2)
    assert [s.window(t) for t in (1, 3, 5)] == [(1, 2), (3, 4), (5, 6)]
    s3 = Schedule(start_step=1, step_interval=2, collect_times=3, step_count_per_record=3)
    assert [s3.window(t) for t in (1, 3, 5)] == [(1, 3), (1, 3), (4, 6)]


def test_window_origin_zero_for_v1() -> None:
    """Monitor V1's reference cuts windows from step 0, not from start_step."""
    s = Schedule(start_step=1, step_interval=2, step_count_per_record=2, record_origin=0)
    assert [s.window(t) for t in (1, 3, 5)] == [(0, 1), (2, 3), (4, 5)]


def test_file_window_names_every_sinks_files() -> None:
    """The names both sinks (CSV, Parquet) give a window's file: its whole window, started no
    earlier than the sink's first step."""
    s = Schedule(start_step=2, step_interval=3, step_count_per_record=10)
    assert s.file_window(5) == (2, 11)
    assert s.file_window(8, first_step=6) == (6, 11)  # a session started inside the window
    assert s.file_window(5, first_step=6) == (5, 11)  # never after the step itself
