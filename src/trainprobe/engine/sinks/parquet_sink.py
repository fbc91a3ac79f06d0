"""Parquet output (``"format": "parquet"``, an extension of the specs, whose default is CSV): one
file per table and window, the CSV layout's names with ``.parquet``
(``rank_0/weight_grad_step0-9.parquet``; V1 ``grad_reduced_0-4.parquet``) and its columns in its
order (:class:`~trainprobe.engine.sinks.csv_sink.TableLayout`): ``vpp_stage``, ``step``,
``micro_step`` int64 (``micro_step`` null where the row has none), names, scope and trailing
text (``shape``, ``dtype``) string, every op float64 (counts too), rounded as the CSV file
would be. The footer carries the file's summary for the query layer
(:mod:`~trainprobe.engine.sinks.parquet_summary`: its first step with a non-finite row, its
columns).

**Every step on disk as soon as it is written: step files, merged when the window closes.** A
table's rows of one step are written, on the writer thread, as a complete Parquet file of their
own named as a one-step window of the same layout (``weight_grad_step15-15.parquet``; V1
``grad_reduced_15-15.parquet``), under ``.<name>.partial`` and renamed, so it is whole when it
appears. The window's own file is written alongside under ``.<window name>.partial``: each
finished step's rows go into it as soon as a full row group (:data:`ROW_GROUP_ROWS` rows) has
gathered, so memory holds less than one row group per table. When the window closes (the first
row of a later window, or :meth:`ParquetSink.close`) the rest and the footer are written, the file
is renamed to the window's name (its whole window, as the CSV sink names it, also for a window
that training or collection ended early), and then its step files are removed. A window of one step (the default
``step_count_per_record``) is its step file: nothing more is written. So a run killed at any
moment, ``kill -9`` included, loses only the rows the writer had not written yet (the step in
progress and the batches queued behind it, as with CSV): every earlier step of its open window is
an ordinary data file that every reader (``trainprobe query``, ``diagnose``, ``diff``,
``report``, ``csv2db``, ``csv2tb``) reads as it is, and that the earlier-run rule sees
(:mod:`~trainprobe.engine.sinks.earlier_runs`: a new run moves them aside, ``overwrite`` removes
them, a resumed run keeps the steps below its own); the window's ``.partial`` file, never whole,
is read by nobody and removed by the next ``start()`` that overwrites or resumes.

Why step files and not one row group per step in the window's file: a Parquet file can be read
only once its footer is written, which happens when it is closed; the row groups of a killed
file cannot be read back without rebuilding that footer, and a recovery at the next start would
leave a killed run's last window unreadable until someone starts it again. Step files cost one
small Parquet file per table and step while a window of several steps is open (about what a
one-step window costs anyway; nothing is read back at close): see ``docs/performance.md``.

A kill between the window file's rename and the removal of its step files leaves both, the same
rows twice: :func:`merged_step_files` names such step files (a one-step file whose rows the
complete file of a longer window of the same table holds), and Monitor V2's ``start()``, Monitor
V1's ``append_output`` and ``trainprobe convert`` remove them.

With ``append`` (Monitor V1's ``append_output``) a file of the same name that an earlier run
left is continued, as the CSV sink continues its file: its rows come first in the file this run
writes in its place.

Faults: a step file that cannot be written (disk full, permissions) raises an :class:`OSError`
naming the file, its ``.partial`` removed; the writer reports it once, naming the monitor, and
disables that monitor. The step files written before stay (whole, readable) and that table's
open window is left as its step files (its window file being written is removed). A window
whose file cannot be completed when it closes also stays as its step files, with one
:class:`OSError` naming the window's file. No ``.partial`` file is left behind.

pyarrow is imported when the first file is written (the engine imports nothing beyond NumPy at
module level); without it the sink's first write raises ImportError, which the writer reports
once, naming the ``[query]`` extra.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.layout import PARQUET_SUFFIX, v2_file_name
from trainprobe.engine.records import RowKey, StepBatch
from trainprobe.engine.safe_files import one_line
from trainprobe.engine.schedule import Schedule
from trainprobe.engine.sinks.csv_sink import TableLayout
from trainprobe.engine.sinks.parquet_summary import SUMMARY_KEY, Summary, encode, op_flags, read_summary, row_is_bad
from trainprobe.engine.stats.ops import COUNT_OPS

ROW_GROUP_ROWS = 1 << 16
"""Rows per row group of a merged window file."""
_INT_COLUMNS = ("vpp_stage", "step", "micro_step")
_INF = float("inf")
INSTALL_HINT = "Parquet output needs pyarrow: pip install 'trainprobe[query]'"
PARTIAL_SUFFIX = ".partial"
"""A file being written is ``.<name>.partial`` (hidden; no reader picks it up)."""


def require_pyarrow(field_name: str) -> None:
    """Raise a ConfigError naming ``field_name`` when pyarrow (Parquet output) is not installed:
    the config is refused at start, not at the first write."""
    import importlib.util

    if importlib.util.find_spec("pyarrow") is None:
        raise ConfigError(f"{field_name}: 'parquet' needs pyarrow; pip install 'trainprobe[query]', or use 'csv'")


def parquet_file_name(table: str, first: int, last: int) -> str:
    """``weight_grad_step0-9.parquet`` (V2's name with the Parquet suffix)."""
    return v2_file_name(table, first, last, PARQUET_SUFFIX)


def partial_path(path: Path) -> Path:
    """``.<name>.partial`` beside ``path``: where ``path`` is written before it gets its name."""
    return path.with_name(f".{path.name}{PARTIAL_SUFFIX}")


@dataclass
class _Piece:
    """A finished file of a window: a step file, or the earlier run's file it continues."""

    path: Path
    rows: int
    first_bad: int | None
    known: bool = True
    """Whether ``first_bad`` is known (False: an earlier run's file without a summary)."""


@dataclass
class _Window:
    table: str
    first: int
    last: int
    layout: TableLayout
    pieces: list[_Piece] = field(default_factory=list)
    step: int | None = None
    """The step whose rows ``parts`` hold (the step file written last)."""
    parts: list[Any] = field(default_factory=list)
    """pyarrow tables of that step's rows: its file is rewritten whole when more arrive."""
    carried: _Piece | None = None
    """The earlier run's rows of that step's file name (``append``)."""
    bad: bool = False
    writer: Any = None
    """The window's file being written (``.<window name>.partial``), from its first full row group."""
    pending: list[Any] = field(default_factory=list)
    """Finished steps' rows not in a row group yet (fewer than :data:`ROW_GROUP_ROWS`)."""
    pending_rows: int = 0


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401  (loads the submodule)
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return pyarrow


class ParquetSink:
    """Writes :class:`StepBatch` objects as Parquet under ``rank_dir`` (see the module docstring).

    Args:
        rank_dir: folder of this rank's files.
        schedule: gives each step's window.
        layouts: table name → layout (the CSV sink's: same columns).
        table_of: the table of a row, from its monitor and key (default: the monitor).
        name_file: file name of a table's window, with the ``.parquet`` suffix.
        first_step: the first step this sink can see (as the CSV sink's).
        append: continue a file of the same name an earlier run left (its rows first) instead
            of replacing it, as the CSV sink's ``append``.
        field: the config field that named the folder: it is created through
            :func:`~trainprobe.engine.folders.make_output_folder` when a window is opened (again
            after it was removed during training), whose ConfigError names ``field``.
    """

    def __init__(
        self,
        rank_dir: Path,
        schedule: Schedule,
        layouts: Mapping[str, TableLayout],
        *,
        table_of: Callable[[str, RowKey], str] | None = None,
        name_file: Callable[[str, int, int], str] = parquet_file_name,
        first_step: int = 0,
        append: bool = False,
        field: str = "output_dir",
    ) -> None:
        self.rank_dir = rank_dir
        self.field = field
        self.schedule = schedule
        self.layouts = dict(layouts)
        self.table_of = table_of
        self.name_file = name_file
        self.first_step = first_step
        self.append = append
        self._open: dict[str, _Window] = {}
        self._schemas: dict[str, Any] = {}
        self._ours: set[Path] = set()  # every file this sink wrote (never "an earlier run's")
        self._failed: set[str] = set()  # tables a write failed for: their windows stay as step files
        self.rows_written: dict[str, int] = {}

    def write(self, batch: StepBatch) -> None:
        """Add the batch's rows to their tables' open windows, each table's step file written
        (again, whole) before this returns. Raises OSError naming the file (disk full,
        permissions), ConfigError (the folder cannot be made), ImportError (no pyarrow)."""
        if not len(batch):
            return
        values = batch.values()
        by_table: dict[str, list[int]] = {}
        for i, key in enumerate(batch.keys):
            table = self.table_of(batch.monitor, key) if self.table_of is not None else batch.monitor
            by_table.setdefault(table, []).append(i)
        for table, picked in by_table.items():
            try:
                window = self._window_for(table, batch.step)
                self._add(window, [batch.keys[i] for i in picked], [values[i] for i in picked], batch.step)
            except BaseException:
                self._failed.add(table)
                failed = self._open.pop(table, None)  # its step files stay as they are on disk
                if failed is not None:
                    self._discard(failed)  # the window's file being written: removed
                raise
        self.rows_written[batch.monitor] = self.rows_written.get(batch.monitor, 0) + len(batch)

    def close(self, reached: int | None = None) -> None:
        """Close every open window (merge its step files into the window's file, named by its whole
        window wherever training stopped: ``reached`` changes no name). Every window is tried; the first fault
        (an OSError naming the window's file, whose step files then stay) is raised at the end."""
        fault: BaseException | None = None
        for table in list(self._open):
            try:
                self._finish(self._open[table])
            except Exception as exc:  # noqa: BLE001 - the other windows are still closed
                fault = fault or exc
        if fault is not None:
            raise fault

    # -- windows and steps ---------------------------------------------------------------
    def _window_for(self, table: str, step: int) -> _Window:
        first, last = self.schedule.file_window(step, self.first_step)
        current = self._open.get(table)
        if current is not None and current.first == first:
            return current
        if current is not None:
            self._finish(current)
        make_output_folder(self.rank_dir, self.field)  # removed during training: made again, or a fault
        window = _Window(table, first, last, self.layouts[table])
        if first != last:  # a one-step window's file is its step file, continued there
            carried = self._carried(table, self.rank_dir / self.name_file(table, first, last))
            if carried is not None:
                window.pieces.append(carried[0])
                self._stream(window, carried[1])
        self._open[table] = window
        return window

    def _add(self, window: _Window, keys: list[RowKey], values: list[list[float]], step: int) -> None:
        pa = _pyarrow()
        path = self.rank_dir / self.name_file(window.table, step, step)
        if window.step != step:
            if window.parts:  # the step before is complete: on its way into the window's file
                self._stream(window, window.parts[0])
            window.step, window.parts, window.bad, window.carried = step, [], False, None
            earlier = self._carried(window.table, path)
            if earlier is not None:
                window.carried = earlier[0]
                window.parts.append(earlier[1])
        columns, bad = _columns(window.layout, keys, values, step)
        schema = self._schema(window.table)
        try:
            table = pa.table({n: pa.array(v, type=schema.field(n).type) for n, v in columns.items()})
        except (UnicodeEncodeError, pa.ArrowInvalid):  # a name UTF-8 cannot encode: as its escape text, as in CSV
            table = pa.table({n: pa.array(_encodable(v), type=schema.field(n).type) for n, v in columns.items()})
        window.parts.append(table)
        window.bad = window.bad or bad
        whole = window.parts[0] if len(window.parts) == 1 else pa.concat_tables(window.parts)
        carried = window.carried
        known = carried is None or carried.known
        first_bad = step if window.bad or (carried is not None and carried.first_bad is not None) else None
        summary = Summary(first_bad, tuple(window.layout.header), int(whole.num_rows)) if known else None
        self._write_file(path, whole, summary)
        piece = _Piece(path, int(whole.num_rows), first_bad, known)
        if window.pieces and window.pieces[-1].path == path:
            window.pieces[-1] = piece
        else:
            window.pieces.append(piece)
        if len(window.parts) > 1:  # later batches of this step rewrite one table, not many
            window.parts = [whole]

    def _finish(self, window: _Window) -> None:
        """Complete ``window``'s file from its pieces, give it its name, remove the pieces (see
        the module doc)."""
        self._open.pop(window.table, None)
        pieces = window.pieces
        if window.table in self._failed or not pieces:
            self._discard(window)
            return
        target = self.rank_dir / self.name_file(window.table, window.first, window.last)
        if len(pieces) == 1 and pieces[0].path in (target, *self._ours):  # one step file: its name is enough
            self._discard(window)
            if pieces[0].path != target:
                os.replace(pieces[0].path, target)
        else:
            if window.parts:
                self._stream(window, window.parts[0])
                window.parts = []
            self._complete(window, target)
        self._ours.add(target)
        for piece in pieces:
            if piece.path != target:
                piece.path.unlink(missing_ok=True)

    def _stream(self, window: _Window, rows: Any) -> None:
        """Add a finished step's ``rows`` (or the earlier run's file continued) to the window's
        file: full row groups are written as they fill, so memory holds less than one."""
        window.pending.append(rows)
        window.pending_rows += int(rows.num_rows)
        if window.pending_rows < ROW_GROUP_ROWS:
            return
        pa = _pyarrow()
        whole = pa.concat_tables(window.pending)
        cut = window.pending_rows // ROW_GROUP_ROWS * ROW_GROUP_ROWS
        self._write_rows(window, whole.slice(0, cut))
        rest = whole.slice(cut)
        window.pending, window.pending_rows = ([rest] if rest.num_rows else []), int(rest.num_rows)

    def _write_rows(self, window: _Window, rows: Any) -> None:
        path = self._window_path(window)
        try:
            if window.writer is None:
                window.writer = _pyarrow().parquet.ParquetWriter(str(partial_path(path)), self._schema(window.table))
            window.writer.write_table(rows, row_group_size=ROW_GROUP_ROWS)
        except OSError as exc:
            self._discard(window)
            raise _fault(path, exc, "cannot be written; its steps stay in their step files") from None

    def _complete(self, window: _Window, target: Path) -> None:
        """Write what is pending and the summary, close the window's file and rename it ``target``."""
        pa = _pyarrow()
        if window.pending or window.writer is None:
            rows = pa.concat_tables(window.pending) if window.pending else self._schema(window.table).empty_table()
            self._write_rows(window, rows)
            window.pending, window.pending_rows = [], 0
        pieces = window.pieces
        partial = partial_path(self._window_path(window))
        try:
            if all(p.known for p in pieces):
                first_bad = min((p.first_bad for p in pieces if p.first_bad is not None), default=None)
                summary = Summary(first_bad, tuple(window.layout.header), sum(p.rows for p in pieces))
                window.writer.add_key_value_metadata({SUMMARY_KEY: encode(summary)})
            writer, window.writer = window.writer, None
            writer.close()
            os.replace(partial, target)
        except OSError as exc:
            raise _fault(target, exc, "cannot be written; its steps stay in their step files") from None
        finally:
            self._discard(window)

    def _discard(self, window: _Window) -> None:
        """Drop the window's file being written (its ``.partial`` removed)."""
        writer, window.writer = window.writer, None
        window.pending, window.pending_rows = [], 0
        if writer is not None:
            try:
                writer.close()
            except Exception:  # noqa: BLE001, S110 - the file is removed below anyway
                pass
            _remove(partial_path(self._window_path(window)))

    def _window_path(self, window: _Window) -> Path:
        """The window's file under its full name (the name it is written under, ``.partial``)."""
        return self.rank_dir / self.name_file(window.table, window.first, window.last)

    def _carried(self, table: str, path: Path) -> tuple[_Piece, Any] | None:
        """With ``append``: the earlier run's file ``path`` (this sink did not write it), as a
        piece and its rows; None when there is none to continue. Raises OSError when it cannot
        be read or holds other columns than this run's table (it is then left as it is)."""
        if not self.append or path in self._ours or not path.is_file():
            return None
        pa = _pyarrow()
        header = self.layouts[table].header
        try:
            rows = pa.parquet.read_table(str(path)).replace_schema_metadata(None)
        except (OSError, pa.ArrowException) as exc:
            raise _fault(path, exc, "cannot read the earlier run's file to continue it") from None
        if rows.column_names != header:
            raise OSError(
                f"{path}: the earlier run's file has other columns ({', '.join(rows.column_names[:8])}) than "
                f"this run's {table} table; it is left as it is and not continued"
            )
        rows = rows.cast(self._schema(table))
        summary = read_summary(path)
        piece = _Piece(path, int(rows.num_rows), summary.first_bad_step if summary else None, summary is not None)
        return piece, rows

    def _schema(self, table: str) -> Any:
        schema = self._schemas.get(table)
        if schema is None:
            pa = _pyarrow()
            layout = self.layouts[table]
            schema = self._schemas[table] = pa.schema([(name, _type(pa, name, layout)) for name in layout.header])
        return schema

    # -- files ---------------------------------------------------------------------------
    def _write_file(self, path: Path, table: Any, summary: Summary | None) -> None:
        """``table`` as the Parquet file ``path``, written under its ``.partial`` name and renamed."""
        pa = _pyarrow()
        partial = partial_path(path)
        metadata = {SUMMARY_KEY: encode(summary)} if summary is not None else None
        try:
            pa.parquet.write_table(table.replace_schema_metadata(metadata), str(partial))
            os.replace(partial, path)
        except OSError as exc:
            raise _fault(path, exc, "cannot be written") from None
        finally:
            _remove(partial)
        self._ours.add(path)


def _columns(layout: TableLayout, keys: list[RowKey], values: list[list[float]], step: int) -> tuple[dict[str, list[Any]], bool]:
    """The rows as columns of ``layout`` (values rounded as in CSV) and whether one of them is
    non-finite by the query layer's rule."""
    cols: dict[str, list[Any]] = {name: [] for name in layout.header}
    ops = layout.ops
    digits = layout.ndigits
    suspect = False  # a NaN, an infinity or a count above 0: the batch may hold a non-finite row
    changed = layout.changes(step)
    for key, row in zip(keys, values):
        for column in layout.key_columns:
            cols[column].append(_key(layout, column, key, step))
        if layout.with_micro_step:
            cols["micro_step"].append(key.micro_step)
        for op, value in zip(ops, row):
            v = float(value)
            if v == v and abs(v) != _INF:
                if op in COUNT_OPS:
                    if v > 0:
                        suspect = True
                elif digits is not None:
                    v = round(v, digits)
            else:
                suspect = True
            cols[op].append(v)
        if layout.trailing:
            for name, cell in zip(layout.trailing, layout.trailing_cells(key, changed)):
                cols[name].append(cell)
    return cols, suspect and _has_bad_row(layout, keys, values)


def _key(layout: TableLayout, column: str, key: RowKey, step: int) -> Any:
    if column == "vpp_stage":
        return key.vpp_stage
    if column == "step":
        return step
    if column in ("module_name", "name"):
        return layout.name_of(key.name) if layout.name_of is not None else key.name
    return key.scope


def _fault(path: Path, exc: BaseException, doing: str) -> OSError:
    """One line naming ``path``: ``[Errno 28] No space left on device: '<path>'`` where the fault
    has an errno, else ``<path>: <doing> (<what pyarrow said>)``."""
    code = getattr(exc, "errno", None)
    if isinstance(code, int) and code > 0:
        return OSError(code, os.strerror(code), str(path))
    return OSError(f"{path}: {doing} ({one_line(str(exc))})")


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a read-only or vanished folder: nothing was left there either
        pass


def merged_step_files(files: Iterable[tuple[Path, str, int, int]]) -> list[Path]:
    """The one-step Parquet files among ``files`` (``(path, table, first, last)`` of one or more
    folders' data files) that a complete file of a longer window of the same table in the same
    folder already holds: a run killed between a window's merge and the removal of its step
    files left them (see the module docstring), and read beside the window's file their rows
    would count twice. A step file counts only when the longer file holds at least as many rows
    of its step as it has rows. Empty when pyarrow is not installed (nothing is judged). Call it
    only on folders no live run writes."""
    groups: dict[tuple[Path, str], list[tuple[Path, int, int]]] = {}
    for path, table, first, last in files:
        if path.suffix == PARQUET_SUFFIX:
            groups.setdefault((path.parent, table), []).append((path, first, last))
    if not groups:
        return []
    try:
        pq = _pyarrow().parquet
    except ImportError:
        return []
    found: set[Path] = set()
    for group in groups.values():
        steps = {first: path for path, first, last in group if first == last}
        for path, first, last in group:
            inside = {s: p for s, p in steps.items() if first <= s <= last and first < last}
            if not inside:
                continue
            try:
                held = pq.read_table(str(path), columns=["step"]).column("step").to_pylist()
                counts: dict[int, int] = {}
                for s in held:
                    counts[s] = counts.get(s, 0) + 1
                for s, p in inside.items():
                    if counts.get(s, 0) >= pq.read_metadata(str(p)).num_rows:
                        found.add(p)
            except Exception:  # noqa: BLE001, S112 - a file pyarrow cannot read is judged by nobody
                continue
    return sorted(found)


def data_files(folder: Path, pattern: re.Pattern[str]) -> list[tuple[Path, str, int, int]]:
    """``(path, table, first, last)`` of the regular files of ``folder`` whose name ``pattern``
    (:data:`~trainprobe.engine.layout.V1_DATA_FILE`, ``V2_DATA_FILE``) matches; none when it
    cannot be listed."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    found = []
    for name in names:
        match = pattern.fullmatch(name)
        path = folder / name
        if match and path.is_file() and not path.is_symlink():
            found.append((path, match["type"], int(match["first"]), int(match["last"])))
    return found


def _has_bad_row(layout: TableLayout, keys: list[RowKey], values: list[list[float]]) -> bool:
    """Whether a row of the batch is non-finite by the query layer's rule
    (:func:`~trainprobe.engine.sinks.parquet_summary.row_is_bad`; rounding to ``ndigits`` keeps a
    value finite or not), tested for the whole batch at once with NumPy; only the rows it flags
    are looked at one by one (a reference-style ``dtype`` of ``'nan'`` is never non-finite).
    Called only for a batch :func:`_columns` saw a suspect value in."""
    flags = op_flags(layout.ops)
    table = np.asarray(values, dtype=np.float64) if values else np.empty((0, len(flags)))
    if table.ndim != 2 or table.shape[1] != len(flags):  # ragged rows: one at a time
        candidates: Any = range(len(values))
    else:
        value_ops = [i for i, f in enumerate(flags) if f == 1]
        count_ops = [i for i, f in enumerate(flags) if f == 2]
        mask = np.zeros(len(values), dtype=bool)
        if value_ops:
            mask |= ~np.isfinite(table[:, value_ops]).all(axis=1)
        if count_ops:
            counts = table[:, count_ops]
            mask |= ((counts > 0) | np.isnan(counts)).any(axis=1)
        candidates = np.flatnonzero(mask).tolist()
    dtype_at = layout.trailing.index("dtype") if "dtype" in layout.trailing else -1
    for i in candidates:
        dtype = None
        if dtype_at >= 0 and layout.describe is not None:
            found = layout.describe(keys[i])
            dtype = found[dtype_at] if dtype_at < len(found) else ""
        if row_is_bad(flags, values[i], dtype):
            return True
    return False


def _type(pa: Any, name: str, layout: TableLayout) -> Any:
    if name in _INT_COLUMNS:
        return pa.int64()
    if name in layout.ops:
        return pa.float64()
    return pa.string()


def _encodable(values: list[Any]) -> list[Any]:
    """Text values UTF-8 can encode (a lone surrogate as its backslash escape), others as they are."""
    return [v.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(v, str) else v for v in values]
