"""The run-level numbers of ``trainprobe report``: loss, learning rate and global gradient norm
over steps, and the parameters that dominate the global gradient norm ("top offenders").

Sources:

* ``training_state.jsonl`` of the training metrics (``monitor_config.dump_path/rank_<id>/``;
  see :mod:`trainprobe.frontdoors.metrics.outputs`): per line ``step``, ``local_loss``,
  ``device_accum_local_loss``, ``device_local_norm`` and ``local_norm/<param>``. A line that is
  not a JSON object with an integer ``step`` (a run killed while writing) is skipped and
  counted. The file carries no learning rate; a ``learning-rate`` (or ``lr``) key is drawn when
  a line has one.
* the TensorBoard event files of the training metrics (``tensorboard_dir/rank_<id>/events.*``):
  the scalars ``loss``, ``learning-rate`` and ``grad-norm``, read event by event (needs the
  ``tensorboard`` package). Only these event files carry the learning rate.
* the gradient groups of the monitor CSVs (V2 ``weight_grad/reduced`` or ``unreduced``, V1
  ``grad_reduced`` or ``grad_unreduced``): their global norm per step (sqrt of the sum of the
  parameters' squared ``norm``) and, through :class:`TopShares`, the top offenders.

Top offenders: per step, the :data:`TOP_K` parameters with the largest squared norm and their
*share*, squared norm / sum of every parameter's squared norm (the share of global norm² each
one carries: the shares of all parameters add up to 1). Over the run, per parameter: in how many
steps it was among the top :data:`TOP_K`, its mean share in those steps, and its share of the
squared norms summed over every step. Files are read one at a time and line by line; memory is
:data:`TOP_K` entries per step and one number per parameter.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once
from trainprobe.engine.safe_files import is_inside, is_regular_file

#: The file the training metrics write per rank (``trainprobe.frontdoors.metrics.outputs.DUMP_FILE``).
TRAINING_STATE = "training_state.jsonl"
#: Parameters kept per step for the top offenders.
TOP_K = 5
#: Rows of the top-offenders table.
OFFENDER_ROWS = 10
#: training_state.jsonl keys drawn, per line chart, in order of preference (all present are drawn).
LOSS_KEYS = ("loss", "local_loss", "device_accum_local_loss")
LR_KEYS = ("learning-rate", "lr")
NORM_KEYS = ("grad-norm", "device_local_norm")
LOCAL_NORM = "local_norm/"
#: The training metrics' TensorBoard scalars drawn (their ``-vs-samples`` twins are not).
TENSORBOARD_TAGS = ("loss", "learning-rate", "grad-norm")
EVENTS = "events.out.tfevents.*"
TENSORBOARD = "TensorBoard"
_RANK_DIR = re.compile(r"^rank_?(\d+)$")


class TopShares:
    """Per step, the sum of the parameters' squared norms and the :data:`TOP_K` largest
    (squared norm, parameter id); per parameter, its squared norms summed over the steps.

    Fed one block of cells at a time (:meth:`add`): one finite squared norm per (parameter,
    step); blocks may split a step's parameters (the top of the union is the top of the tops).
    """

    def __init__(self, k: int = TOP_K) -> None:
        self.k = k
        self.total: dict[int, float] = {}
        self.top: dict[int, list[tuple[float, int]]] = {}
        self.energy = np.zeros(0, dtype=np.float64)

    def add(self, steps: np.ndarray, targets: np.ndarray, squares: np.ndarray) -> None:
        """Fold cells (step, parameter id, squared norm) in; every square must be finite."""
        if not len(steps):
            return
        size = int(targets.max()) + 1
        if size > len(self.energy):
            self.energy = np.concatenate([self.energy, np.zeros(size - len(self.energy))])
        np.add.at(self.energy, targets, squares)
        grid = _step_grid(steps, targets)
        if grid is not None:  # every step with the same parameters: one small sort per step
            self._fold(*_grid_tops(grid, steps, targets, squares, self.k))
            return
        order = np.lexsort((targets, -squares, steps))
        ordered = steps[order]
        starts = np.r_[0, np.flatnonzero(ordered[1:] != ordered[:-1]) + 1]
        ends = np.r_[starts[1:], len(order)]
        in_order = squares[order]
        sums = [float(in_order[a:b].sum()) for a, b in zip(starts.tolist(), ends.tolist())]  # as numpy sums a step
        place = np.arange(len(order)) - np.repeat(starts, ends - starts)
        kept = order[place < self.k]  # each step's k largest, largest first
        kept_steps = steps[kept].tolist()
        pairs = list(zip(squares[kept].tolist(), targets[kept].tolist()))
        bounds = np.r_[0, np.flatnonzero(np.diff(steps[kept])) + 1, len(kept)].tolist()
        self._fold(
            [kept_steps[start] for start in bounds[:-1]],
            sums,
            [pairs[start:end] for start, end in zip(bounds[:-1], bounds[1:])],
        )

    def _fold(self, steps: list[int], sums: list[float], tops: list[list[tuple[float, int]]]) -> None:
        """Add each step's sum and merge its k largest (squared norm, parameter id), largest first."""
        if self.total.keys().isdisjoint(steps):  # steps new to it (a file's): no merging, one update
            self.total.update(zip(steps, sums))  # a sum of squares is never -0.0: 0.0 + sum is sum
            self.top.update(zip(steps, tops))
            return
        for step, total, best in zip(steps, sums, tops):
            self.total[step] = self.total.get(step, 0.0) + total
            old = self.top.get(step)
            self.top[step] = best if old is None else sorted(old + best, key=lambda p: (-p[0], p[1]))[: self.k]


def _step_grid(steps: np.ndarray, targets: np.ndarray) -> np.ndarray | None:
    """The cells' order as a ``(steps, parameters)`` grid when every step of the block has the
    same number of cells and, taken in the cells' order, its parameter ids ascend (a file's steps
    in order, parameters in model order): each row one step, ascending; else None."""
    order = np.argsort(steps, kind="stable")  # cheap on the runs of ascending steps a block holds
    ordered = steps[order]
    change = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    width = int(change[0]) if len(change) else len(ordered)
    if len(ordered) % width or (len(change) and not (np.diff(np.r_[0, change, len(ordered)]) == width).all()):
        return None
    grid = order.reshape(-1, width)
    if width > 1 and not (np.diff(targets[grid], axis=1) > 0).all():
        return None
    return grid


def _grid_tops(
    grid: np.ndarray, steps: np.ndarray, targets: np.ndarray, squares: np.ndarray, k: int
) -> tuple[list[int], list[float], list[list[tuple[float, int]]]]:
    """Per row of ``grid`` (:func:`_step_grid`): its step, the sum of its squares (added largest
    first, as :meth:`TopShares.add` sums a step) and its ``k`` largest (square, id), ties by id."""
    values = squares[grid]
    order = np.argsort(-values, axis=1, kind="stable")  # ties: the smaller id first (ids ascend along a row)
    ranked = np.take_along_axis(values, order, axis=1)
    ids = np.take_along_axis(targets[grid], order[:, :k], axis=1)
    sums = ranked.sum(axis=1).tolist()
    tops = [list(zip(row, keys)) for row, keys in zip(ranked[:, :k].tolist(), ids.tolist())]
    return steps[grid[:, 0]].tolist(), sums, tops


@dataclass
class OffenderRow:
    """One row of the top-offenders table."""

    name: str
    steps_in_top: int
    mean_share: float
    run_share: float


@dataclass
class Offenders:
    """The top offenders of one source (a gradient group or training_state.jsonl) on one rank.

    Attributes:
        source: ``weight_grad/reduced`` or ``training_state.jsonl``.
        rank: the rank.
        steps: steps with at least one finite parameter norm, ascending.
        norm: per step, the global norm: sqrt(sum of squared norms).
        top_ids: ``(steps, k)`` parameter ids, largest share first; -1 where fewer parameters.
        top_share: same shape, squared norm / sum of squared norms (NaN where no parameter;
            0 where every norm of the step is 0).
        names: parameter id → name.
        rows: the table: parameters most often in the top k (ties: larger run share first).
    """

    source: str
    rank: int
    steps: np.ndarray
    norm: np.ndarray
    top_ids: np.ndarray
    top_share: np.ndarray
    names: list[str]
    rows: list[OffenderRow] = field(default_factory=list)


def offenders_of(shares: TopShares, names: list[str], source: str, rank: int) -> Offenders | None:
    """The :class:`Offenders` of what ``shares`` gathered (None when it holds no step)."""
    if not shares.total:
        return None
    steps = np.array(sorted(shares.total), dtype=np.int64)
    totals = np.array([shares.total[int(s)] for s in steps], dtype=np.float64)
    ids = np.full((len(steps), shares.k), -1, dtype=np.int64)
    squares = np.full(ids.shape, np.nan)
    for row, step in enumerate(steps.tolist()):
        for column, (square, target) in enumerate(shares.top[step]):
            ids[row, column], squares[row, column] = target, square
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(totals[:, None] > 0, squares / totals[:, None], np.where(ids >= 0, 0.0, np.nan))
    result = Offenders(source, rank, steps, np.sqrt(totals), ids, share, names)
    result.rows = offender_rows(ids, share, shares.energy, float(totals.sum()), names)
    return result


def offender_rows(
    ids: np.ndarray, share: np.ndarray, energy: np.ndarray, total: float, names: list[str], limit: int = OFFENDER_ROWS
) -> list[OffenderRow]:
    """The ``limit`` parameters most often among a step's top k (ties: larger share of the
    run's summed squared norms first), with their mean share in those steps."""
    kept = ids >= 0
    counts = np.bincount(ids[kept], minlength=len(energy))
    sums = np.bincount(ids[kept], weights=share[kept], minlength=len(energy))
    run_share = energy / total if total > 0 else np.zeros(len(energy))
    candidates = np.flatnonzero(counts > 0)
    order = candidates[np.lexsort((candidates, -run_share[candidates], -counts[candidates]))][:limit]
    return [OffenderRow(names[i], int(counts[i]), float(sums[i] / counts[i]), float(run_share[i])) for i in order]


# --------------------------------------------------------------------------- training_state.jsonl


@dataclass
class Series:
    """One line of the training curves: ``key`` of ``source`` on ``rank`` (NaN/inf kept); for a
    norm computed from the gradient CSVs, ``nonfinite`` flags the steps where some parameter's
    norm was NaN/inf (left out of the sum)."""

    key: str
    source: str
    rank: int
    steps: np.ndarray
    values: np.ndarray
    nonfinite: np.ndarray | None = None


@dataclass
class TrainingState:
    """What the ``training_state.jsonl`` files hold.

    Attributes:
        files: the ``training_state.jsonl`` files read.
        event_files: the TensorBoard event files read.
        loss_files: the ``loss.csv`` files read (:mod:`~trainprobe.tools.reporting.loss`).
        skipped: lines skipped (torn, not JSON, no integer ``step``).
        series: the lines of :data:`LOSS_KEYS`, :data:`LR_KEYS` and :data:`NORM_KEYS` present.
        offenders: per rank, from the ``local_norm/<param>`` keys (when there are any).
    """

    files: list[Path] = field(default_factory=list)
    event_files: list[Path] = field(default_factory=list)
    loss_files: list[Path] = field(default_factory=list)
    skipped: int = 0
    series: list[Series] = field(default_factory=list)
    offenders: dict[int, Offenders] = field(default_factory=dict)


def rank_of(folder: Path) -> int:
    """The rank of a ``rank_<id>`` (or ``rank<id>``) folder; 0 for any other folder."""
    found = _RANK_DIR.match(folder.name)
    return int(found.group(1)) if found else 0


def find_training_state(root: Path, given: str | Path | None = None) -> list[tuple[int, Path]]:
    """(rank, file) of the ``training_state.jsonl`` files to draw, by rank.

    ``given`` (``--training-state``): the file, a ``rank_<id>`` folder, or ``dump_path`` holding
    ``rank_<id>/`` folders. Without it they are looked for in ``root`` (the monitor output),
    its ``rank_<id>/`` folders and one level below (a dump_path placed inside it).

    Raises:
        ConfigError: ``given`` is missing or holds no ``training_state.jsonl``.
    """
    if given is not None:
        path = Path(given).expanduser()
        if not path.exists():
            raise ConfigError(f"training_state: {str(path)!r} does not exist; pass the training metrics' dump_path")
        found = _files_under(path, deep=False) if path.is_dir() else [path]
        if not found:
            raise ConfigError(
                f"training_state: no {TRAINING_STATE} in {str(path)!r} or its rank_<id>/ folders; "
                "pass monitor_config.dump_path of the training metrics"
            )
    else:
        found = _files_under(root, deep=True) if root.is_dir() else []
    by_rank: dict[int, Path] = {}
    for file in found:
        by_rank.setdefault(rank_of(file.parent), file)
    return sorted(by_rank.items())


def _files_under(folder: Path, deep: bool) -> list[Path]:
    patterns = [TRAINING_STATE, f"rank*/{TRAINING_STATE}"] + ([f"*/rank*/{TRAINING_STATE}"] if deep else [])
    return sorted(
        {p for pattern in patterns for p in folder.glob(pattern) if is_regular_file(p) and is_inside(p, folder)}
    )


def read_training_state(files: list[tuple[int, Path]]) -> TrainingState:
    """Read each rank's file line by line (see the module docstring)."""
    state = TrainingState()
    for rank, path in files:
        state.files.append(path)
        values: dict[str, dict[int, float]] = {}
        names: dict[str, int] = {}
        shares = TopShares()
        skipped = 0
        with path.open("rb") as handle:
            for line in handle:
                row = _json_row(line)
                if row is None:
                    skipped += 1
                    continue
                step = cast(int, row["step"])  # _json_row keeps only rows with an integer step
                for key in (*LOSS_KEYS, *LR_KEYS, *NORM_KEYS):
                    number = _number(row.get(key))
                    if number is not None:
                        values.setdefault(key, {})[step] = number
                _add_local_norms(shares, names, step, row)
        if skipped:
            warn_once(f"jsonl:{path}", f"{path}: skipped {skipped} line(s) that are not whole JSON objects with a step")
        state.skipped += skipped
        for key, by_step in values.items():
            steps = np.array(sorted(by_step), dtype=np.int64)
            numbers = np.array([by_step[int(s)] for s in steps], dtype=np.float64)
            state.series.append(Series(key, TRAINING_STATE, rank, steps, numbers))
        found = offenders_of(shares, list(names), TRAINING_STATE, rank)
        if found is not None:
            state.offenders[rank] = found
    return state


def _json_row(line: bytes) -> dict[str, object] | None:
    """A line as a JSON object with an integer ``step``, or None (torn or foreign)."""
    if not line.endswith(b"\n"):
        return None
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int) or isinstance(row["step"], bool):
        return None
    return row


def _number(value: object) -> float | None:
    """A JSON number as float (NaN/inf kept), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _add_local_norms(shares: TopShares, names: dict[str, int], step: int, row: dict[str, object]) -> None:
    """Fold the finite ``local_norm/<param>`` values of one line into ``shares``."""
    ids, squares = [], []
    for key, value in row.items():
        number = _number(value)
        if key.startswith(LOCAL_NORM) and number is not None and math.isfinite(number * number):
            ids.append(names.setdefault(key[len(LOCAL_NORM) :], len(names)))
            squares.append(number * number)
    if ids:
        targets = np.array(ids, dtype=np.int64)
        shares.add(np.full(len(ids), step, dtype=np.int64), targets, np.array(squares, dtype=np.float64))


# --------------------------------------------------------------------------- TensorBoard


def find_event_files(root: Path, given: str | Path | None = None) -> list[tuple[int, Path]]:
    """(rank, file) of the TensorBoard event files to read, in name (time) order.

    ``given`` (``--tensorboard``): an event file, a ``rank_<id>`` folder, or the metrics'
    ``tensorboard_dir`` holding ``rank_<id>/`` folders. Without it they are looked for in the
    ``rank_<id>/`` folders of ``root`` and one level below (the monitors' own event files, in
    other folders, are not read).

    Raises:
        ConfigError: ``given`` is missing or holds no event file.
    """
    if given is None:
        patterns = [f"rank_*/{EVENTS}", f"*/rank_*/{EVENTS}"]
        found = [p for pattern in patterns for p in root.glob(pattern)] if root.is_dir() else []
    else:
        path = Path(given).expanduser()
        if not path.exists():
            raise ConfigError(f"tensorboard: {str(path)!r} does not exist; pass the training metrics' tensorboard_dir")
        found = [path] if path.is_file() else [p for pattern in (EVENTS, f"rank*/{EVENTS}") for p in path.glob(pattern)]
        if not found:
            raise ConfigError(
                f"tensorboard: no {EVENTS} file in {str(path)!r} or its rank_<id>/ folders; "
                "pass tensorboard.tensorboard_dir of the training metrics"
            )
    base = root if given is None else Path(given).expanduser()
    found = [p for p in found if p == base or is_inside(p, base)]  # links found inside lead nowhere else
    files = sorted({p for p in found if is_regular_file(p)}, key=lambda p: (str(p.parent), p.name))
    return [(rank_of(p.parent), p) for p in files]


def read_event_files(files: list[tuple[int, Path]], state: TrainingState, required: bool) -> None:
    """Add the :data:`TENSORBOARD_TAGS` scalars of ``files`` to ``state.series`` (a later file's
    value of a step wins). Without the ``tensorboard`` package: a ConfigError when ``required``
    (``--tensorboard`` given), else a warning and nothing read.

    Raises:
        ConfigError: see above; an event file that cannot be read (the message names it).
    """
    if not files:
        return
    try:
        from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader
    except ImportError:
        message = "reading TensorBoard event files needs the tensorboard package; pip install tensorboard"
        if required:
            raise ConfigError(f"tensorboard: {message}") from None
        warn_once("report:tensorboard", f"report: {message} (the learning rate is not drawn)")
        return
    values: dict[tuple[str, int], dict[int, float]] = {}
    for rank, path in files:
        state.event_files.append(path)
        try:
            for event in LegacyEventFileLoader(str(path)).Load():
                for value in event.summary.value:
                    if value.tag in TENSORBOARD_TAGS and value.HasField("simple_value"):
                        values.setdefault((value.tag, rank), {})[int(event.step)] = float(value.simple_value)
        except Exception as exc:  # noqa: BLE001 - a damaged file from a user: one line naming it
            raise ConfigError(f"tensorboard: {path}: cannot read the event file: {exc}") from None
    for tag in TENSORBOARD_TAGS:
        for (key, rank), by_step in sorted(values.items()):
            if key == tag:
                steps = np.array(sorted(by_step), dtype=np.int64)
                numbers = np.array([by_step[int(s)] for s in steps], dtype=np.float64)
                state.series.append(Series(tag, TENSORBOARD, rank, steps, numbers))
