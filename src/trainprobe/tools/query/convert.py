"""Convert a run's CSV data files to Parquet (``trainprobe convert RUN --to parquet [--remove-csv]``).

Each CSV file ``<name>.csv`` of either tool's layout (V1 or V2, trainprobe's or the reference's)
gets a ``<name>.parquet`` beside it with the same columns in the same order (keys and
``micro_step`` BIGINT, names and ``shape``/``dtype`` VARCHAR, ops DOUBLE; an empty cell NULL) and
the same rows, a torn last record left out. Its footer carries the summary the sink's files
carry (:mod:`~trainprobe.engine.sinks.parquet_summary`: the first step with a non-finite row, the
columns), so a converted run answers "first NaN/inf" from its footers as a run written as
Parquet does. The query layer reads the result exactly as it read the CSV files
(``tests/test_query.py`` checks the answers agree). A CSV file that has a Parquet file already
(an earlier convert without ``--remove-csv``) is converted again, so the Parquet file, which the
readers prefer, is never older than its CSV file.

What is never lost or mixed (``tests/test_parquet_safety.py``):

* **A live run**: a folder a run still writes (it holds the folder's lock,
  :mod:`~trainprobe.engine.folder_lock`) has its closed windows converted only. A window is
  closed once the same table has a later window file holding a row (a writer closes a window
  before it writes into the next one); the newest window of each table, and one whose next
  window is still empty, is left as it is, with one warning line naming it. Convert again once
  the run has moved on or ended. Where locks are not available (a file system without ``flock``)
  one warning says that whether a run still writes there cannot be told. While a folder that no run writes is converted, a run starting
  to write it is refused (``reading``'s shared lock), so its files stay as convert found them.
* **The CSV file** stays until its Parquet file is whole and verified: written under a hidden
  ``.<name>.parquet.convert.partial``, read back (its row count and columns equal to the CSV
  file's records and header, its summary's row count too), flushed to disk, and renamed; only
  then does ``--remove-csv`` delete the CSV file.
* **Two converts at once** on one run: each CSV file is converted under an exclusive lock on it
  (the other convert waits, then finds it converted or removed); the temporary name is only
  used under that lock. Neither fails nor corrupts a file.
* **Faults** (a cell that is not a number, a read-only folder, a full disk): a
  :class:`~trainprobe.engine.errors.ConfigError` of one line naming the file, no traceback; the
  temporary file is removed and the CSV file is kept. Files converted before stay converted.
* **A Parquet run killed in the middle of merging a window** left its step files beside the
  merged file (:func:`~trainprobe.engine.sinks.parquet_sink.merged_step_files`): in a folder no
  run writes they are removed, so no row counts twice.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folder_lock import reading
from trainprobe.engine.layout import PARQUET_SUFFIX
from trainprobe.engine.log import logger
from trainprobe.engine.safe_files import is_regular_file
from trainprobe.engine.sinks.parquet_sink import merged_step_files
from trainprobe.engine.sinks.parquet_summary import NON_OPS, SUMMARY_KEY, Summary, encode, read_summary
from trainprobe.tools.query.layer import require, short_error
from trainprobe.tools.runs.files import RunFile, clean_length, csv_header, find_run_files
from trainprobe.tools.sql.names import ident as quote
from trainprobe.tools.sql.names import text as literal
from trainprobe.tools.sql.questions import TEXT_COLUMNS, bad_rows_sql
from trainprobe.tools.sql.views import read_csv_sql

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

TEMP_SUFFIX = ".convert.partial"
"""``.<name>.parquet.convert.partial``: a Parquet file being converted (hidden from readers)."""


def convert_run(run: str | Path, remove_csv: bool = False) -> list[Path]:
    """Write the Parquet file of every closed CSV data file of ``run``; returns the files written.

    See the module docstring: windows a live run still writes are skipped (one warning line);
    each Parquet file is verified before ``remove_csv`` deletes its CSV file.

    Raises:
        ConfigError: ``run`` holds no CSV data file; DuckDB is not installed; a file cannot be
            converted (a bad cell, a read-only folder, a full disk: one line naming the file;
            the CSV file is kept, nothing half-written is left).
    """
    duck = require("duckdb")
    files = find_run_files(run)
    csv_files = _csv_files(files)
    if not csv_files:
        raise ConfigError(f"run: no CSV data file under {str(run)!r} to convert")
    folders: dict[Path, list[RunFile]] = {}
    for f in csv_files:
        folders.setdefault(f.path.parent, []).append(f)
    written: list[Path] = []
    held: list[Path] = []
    con = duck.connect()
    try:
        for folder, group in folders.items():
            with reading(folder) as live:
                if live is None:
                    logger.warning(
                        "trainprobe convert: cannot tell whether a run still writes %s (no file locks there); "
                        "every window is converted: convert only a run that has ended",
                        folder,
                    )
                still_open = _open_windows(group) if live else set()
                held.extend(f.path for f in group if f.path in still_open)
                for f in group:
                    if f.path not in still_open:
                        target = _convert_locked(con, duck, f, remove_csv)
                        if target is not None:
                            written.append(target)
                if live is False:
                    _drop_merged_step_files(folder, files)
    finally:
        con.close()
    if held:
        more = f", nor {len(held) - 1} more such file(s)" if len(held) > 1 else ""
        logger.warning(
            "trainprobe convert: %s is still being written by a run that is going (its window is open), "
            "not converted%s; convert again once the run has moved past it or ended",
            held[0],
            more,
        )
    return written


def _csv_files(files: list[RunFile]) -> list[RunFile]:
    """The CSV files of ``files``, and the CSV file beside each Parquet file (which
    :func:`find_run_files` leaves out when both exist: the readers read the Parquet one)."""
    found = [f for f in files if f.format == "csv"]
    for f in files:
        twin = f.path.with_suffix(".csv")
        if f.format == "parquet" and not twin.is_symlink() and is_regular_file(twin):
            found.append(RunFile(twin, f.layout, "csv", f.rank, f.table, f.first_step, f.last_step))
    return sorted(found, key=lambda f: (f.table, f.rank, f.first_step, str(f.path)))


def _open_windows(group: list[RunFile]) -> set[Path]:
    """The CSV files of one live folder whose window may still be open: for each table, the
    newest, and every window no later window of the table holds a row after."""
    by_table: dict[str, list[RunFile]] = {}
    for f in group:
        by_table.setdefault(f.table, []).append(f)
    still_open: set[Path] = set()
    for windows in by_table.values():
        later_has_rows = False
        for f in sorted(windows, key=lambda w: (w.first_step, w.last_step), reverse=True):
            if not later_has_rows:
                still_open.add(f.path)
            later_has_rows = later_has_rows or _has_rows(f.path)
    return still_open


def _has_rows(path: Path) -> bool:
    """Whether the CSV file holds anything after its header line (a writer wrote into it)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1 << 16)
            size = os.fstat(handle.fileno()).st_size
    except OSError:
        return False
    end = head.find(b"\n")
    return end >= 0 and size > end + 1


def _drop_merged_step_files(folder: Path, files: list[RunFile]) -> None:
    """Remove the step files a Parquet run killed mid-merge left in ``folder`` (see the module doc)."""
    mine = [(f.path, f.table, f.first_step, f.last_step) for f in files if f.path.parent == folder]
    for path in merged_step_files(mine):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"{path}: a step file already merged into its window's file cannot be removed: {exc.strerror or exc}") from None
        logger.info("trainprobe convert: %s removed: its rows are in its window's merged file already", path)


def _convert_locked(con: Any, duck: Any, f: RunFile, remove_csv: bool) -> Path | None:
    """Convert ``f`` under the exclusive lock on it; the Parquet file written, or None when
    there was nothing to convert (removed by another convert meanwhile, or no header yet)."""
    with _exclusive(f.path) as present:
        if not present:
            return None
        header = csv_header(f.path)
        if header is None:
            return None
        target = f.path.with_suffix(PARQUET_SUFFIX)
        temp = target.with_name(f".{target.name}{TEMP_SUFFIX}")
        try:
            rows = convert_file(con, f.path, header, temp)
            _verify(con, temp, header, rows, f.path)
            _sync(temp)
            os.replace(temp, target)
            _sync(target.parent)
        except duck.Error as exc:
            raise ConfigError(f"{f.path}: not converted, the CSV file is kept: {short_error(str(exc))}") from None
        except OSError as exc:
            where = exc.filename or target
            raise ConfigError(
                f"{where}: cannot be written ({exc.strerror or exc}); {f.path.name} is kept as it is"
            ) from None
        finally:
            _remove(temp)
        if remove_csv:
            try:
                f.path.unlink()
            except OSError as exc:
                raise ConfigError(f"{f.path}: converted, but cannot be removed: {exc.strerror or exc}") from None
    return target


@contextmanager
def _exclusive(path: Path) -> Iterator[bool]:
    """An exclusive lock on the CSV file ``path`` (waits for another convert holding it);
    yields whether ``path`` is still that file (False: removed, or replaced, meanwhile)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        yield False
        return
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: converts there must not overlap
                pass
        try:
            now = os.stat(path)
        except FileNotFoundError:
            yield False
            return
        held = os.fstat(fd)
        yield (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino)
    finally:
        os.close(fd)


def convert_file(con: object, path: Path, header: tuple[str, ...], target: Path) -> int:
    """``path`` (CSV with ``header``) as Parquet at ``target``; returns the number of records of
    ``path`` (its complete part, counted apart from DuckDB, for :func:`_verify`). Raises
    DuckDB's errors (a bad cell), OSError (the target cannot be written)."""
    cut = clean_length(path)
    source = str(path)
    temp_csv: str | None = None
    if cut is not None:  # a torn last record: read the complete part only
        fd, temp_csv = tempfile.mkstemp(suffix=".csv", prefix="trainprobe-torn-")
        with open(path, "rb") as handle, os.fdopen(fd, "wb") as out:
            out.write(handle.read(cut))
        source = temp_csv
    try:
        records = _count_records(Path(source))
        columns = ", ".join(quote(h) for h in header)
        con.execute(  # type: ignore[attr-defined]
            f"CREATE OR REPLACE TEMP TABLE __convert AS SELECT {columns} FROM {read_csv_sql([source], header)} "
            "ORDER BY ordinality"
        )
        write_parquet(con, "__convert", header, target)
    finally:
        con.execute("DROP TABLE IF EXISTS __convert")  # type: ignore[attr-defined]
        if temp_csv is not None:
            os.unlink(temp_csv)
    return records


def _count_records(path: Path) -> int:
    """The data records of the CSV file ``path`` (every line but the header; blank lines are no
    record, as for DuckDB): line breaks counted, or, where a quote, a carriage return or a blank
    line could make a line break no record's end, the ``csv`` module's records."""
    breaks = 0
    plain = True
    last = b"\n"
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            breaks += chunk.count(b"\n")
            if b'"' in chunk or b"\r" in chunk or b"\n\n" in chunk or (last == b"\n" and chunk[:1] == b"\n"):
                plain = False
                break
            last = chunk[-1:]
    if plain:
        return max(0, breaks - (1 if last == b"\n" else 0))
    with open(path, newline="", encoding="utf-8", errors="replace") as text:
        return max(0, sum(1 for row in csv.reader(text) if row) - 1)


def _verify(con: Any, parquet: Path, header: tuple[str, ...], records: int, source: Path) -> None:
    """The Parquet file ``parquet`` read back: ``records`` rows, the columns ``header``, a
    summary saying so; else a ConfigError naming ``source`` (which is kept)."""
    listed = literal(str(parquet))
    [(rows,)] = con.execute(f"SELECT count(*) FROM read_parquet({listed})").fetchall()
    columns = tuple(str(r[0]) for r in con.execute(f"DESCRIBE SELECT * FROM read_parquet({listed})").fetchall())
    summary = read_summary(parquet)
    if rows != records or columns != header or summary is None or summary.rows != records:
        raise ConfigError(
            f"{source}: not converted, the CSV file is kept: the Parquet file read back holds {rows} rows and "
            f"{len(columns)} columns, the CSV file {records} records and {len(header)} columns"
        )


def _sync(path: Path) -> None:
    """Flush ``path`` (a file or a folder) to disk; a folder that cannot be flushed is left as it is."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _remove(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:  # a read-only folder: nothing could be written there either
        pass


def write_parquet(con: object, table: str, header: tuple[str, ...], path: Path) -> None:
    """Table ``table`` of ``con`` (a data file's columns ``header``, rows in file order) as the
    Parquet file ``path``, with its summary in the footer."""
    ops = [h for h in header if h not in NON_OPS]
    bad = bad_rows_sql(["step", *ops, *(t for t in TEXT_COLUMNS if t in header)])
    [(first_bad, rows)] = con.execute(  # type: ignore[attr-defined]
        f"SELECT min(step) FILTER (WHERE {bad}), count(*) FROM {quote(table)}"
    ).fetchall()
    summary = encode(Summary(None if first_bad is None else int(first_bad), header, int(rows)))
    columns = ", ".join(quote(h) for h in header)
    con.execute(  # type: ignore[attr-defined]
        f"COPY (SELECT {columns} FROM {quote(table)}) TO {literal(str(path))} "
        f"(FORMAT parquet, KV_METADATA {{{SUMMARY_KEY}: {literal(summary)}}})"
    )

