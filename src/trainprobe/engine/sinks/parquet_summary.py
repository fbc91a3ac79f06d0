"""The summary a Parquet data file written by trainprobe carries in its footer, for the query layer.

Every Parquet data file trainprobe writes (the :class:`~trainprobe.engine.sinks.parquet_sink.ParquetSink`
of ``"format": "parquet"``, ``trainprobe convert``, the earlier-run rule's rewrite) has one
key-value entry in its footer, key :data:`SUMMARY_KEY`, whose value is JSON::

    {"version": 1, "rows": 20000, "first_bad_step": 321, "columns": ["vpp_stage", "step", ...]}

``first_bad_step`` is the first step of the file with a non-finite row, by the query layer's
rule (:func:`row_is_bad`, the same as :func:`trainprobe.tools.sql.questions.bad_rows_sql`), or null
when it has none; ``columns`` are the file's columns in order; ``rows`` its row count. The query
layer answers "first NaN/inf" from these footers alone (:func:`read_summary`: a few KB read per
file, no DuckDB) and reads rows only of the files holding that step's first non-finite row. A
file without the entry (written by another tool, or an older trainprobe), or whose row count
differs from the summary's (rewritten by a tool that copied the entry), is read row by row as
before. Standard library only.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

SUMMARY_KEY = "trainprobe"
"""The footer key of the summary."""
VERSION = 1
"""The summary's format; a reader ignores a summary of another version."""
COUNT_OPS = frozenset({"nans"})
"""Ops that count non-finite elements: above 0 (or NaN) makes the row non-finite."""
NON_OPS = frozenset({"vpp_stage", "step", "micro_step", "name", "module_name", "scope", "shape", "dtype"})
"""The columns of a data file (either layout) that are not ops."""


@dataclass(frozen=True)
class Summary:
    """A file's summary: its first step with a non-finite row (None: none), its columns and its
    row count."""

    first_bad_step: int | None
    columns: tuple[str, ...]
    rows: int


def encode(summary: Summary) -> str:
    """The footer value of ``summary`` (JSON)."""
    return json.dumps(
        {
            "version": VERSION,
            "rows": summary.rows,
            "first_bad_step": summary.first_bad_step,
            "columns": list(summary.columns),
        }
    )


def decode(value: str | bytes) -> Summary | None:
    """The summary in a footer value, or None when it is not one of this version (the reader
    then reads the file's rows instead)."""
    try:
        data = json.loads(value)
        step, columns, rows = data["first_bad_step"], data["columns"], data["rows"]
    except (ValueError, TypeError, KeyError):
        return None
    if isinstance(rows, bool) or not isinstance(rows, int):
        return None
    if data.get("version") != VERSION or not isinstance(columns, list) or not all(isinstance(c, str) for c in columns):
        return None
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        return None
    return Summary(step, tuple(columns), rows)


_MAGIC = b"PAR1"
_ENTRY = b"\x18" + bytes([len(SUMMARY_KEY)]) + SUMMARY_KEY.encode() + b"\x18"
"""A KeyValue struct's key field holding :data:`SUMMARY_KEY`, then its value field's header
(Thrift compact protocol: field delta 1, type binary, the length as a varint)."""
_MAX_FOOTER = 1 << 24


def read_summary(path: Path) -> Summary | None:
    """The summary in the footer of Parquet file ``path``, read without a Parquet library: the
    footer's bytes, its row count (``FileMetaData`` fields 1-3, Thrift compact protocol) and
    the last key-value entry with key :data:`SUMMARY_KEY`. None when the file has no such
    entry, it does not decode, its row count differs from the file's, or the file cannot be
    read as Parquet (the caller then reads the file's rows)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, 2)
            size = handle.tell()
            if size < 12:
                return None
            handle.seek(size - 8)
            tail = handle.read(8)
            length = struct.unpack("<I", tail[:4])[0]
            if tail[4:] != _MAGIC or length > min(size - 12, _MAX_FOOTER):
                return None
            handle.seek(size - 8 - length)
            footer = handle.read(length)
        rows = _num_rows(footer)
        at = footer.rfind(_ENTRY)
        if rows is None or at < 0:
            return None
        size_at = at + len(_ENTRY)
        value_size, start = _varint(footer, size_at)
        summary = decode(footer[start : start + value_size])
    except (OSError, IndexError, ValueError, struct.error):
        return None
    return summary if summary is not None and summary.rows == rows else None


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """The unsigned varint at ``at`` and the offset after it."""
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def _num_rows(footer: bytes) -> int | None:
    """``FileMetaData.num_rows`` (field 3, i64) of a Thrift compact footer: fields 1 (version)
    and 2 (schema) are skipped."""
    at, field = 0, 0
    while True:
        header = footer[at]
        at += 1
        if header == 0:  # the struct's end: no num_rows
            return None
        kind, delta = header & 0x0F, header >> 4
        if delta:
            field += delta
        else:
            raw, at = _varint(footer, at)
            field = (raw >> 1) ^ -(raw & 1)
        if field == 3 and kind == 6:
            raw, _ = _varint(footer, at)
            return (raw >> 1) ^ -(raw & 1)
        if field > 3:
            return None
        at = _skip(footer, at, kind)


def _skip(data: bytes, at: int, kind: int) -> int:
    """The offset after a value of compact type ``kind`` at ``at``."""
    if kind in (1, 2):  # bool, in the field header
        return at
    if kind == 3:
        return at + 1
    if kind in (4, 5, 6):
        return _varint(data, at)[1]
    if kind == 7:
        return at + 8
    if kind == 8:
        size, at = _varint(data, at)
        return at + size
    if kind in (9, 10):
        header = data[at]
        at += 1
        count, element = header >> 4, header & 0x0F
        if count == 15:
            count, at = _varint(data, at)
        for _ in range(count):
            at = 1 + at if element in (1, 2) else _skip(data, at, element)
        return at
    if kind == 11:
        count, at = _varint(data, at)
        if count:
            types = data[at]
            at += 1
            for _ in range(count):
                at = _skip(data, at, types >> 4)
                at = _skip(data, at, types & 0x0F)
        return at
    if kind == 12:
        while True:
            header = data[at]
            at += 1
            if header == 0:
                return at
            if not header >> 4:
                at = _varint(data, at)[1]
            at = _skip(data, at, header & 0x0F)
    raise ValueError(f"unknown Thrift compact type {kind}")


def op_flags(columns: Sequence[str]) -> list[int]:
    """Per column of a data file: 0 not an op, 1 a value op (bad when NaN or infinite), 2 a count
    op (bad when above 0 or NaN)."""
    return [0 if c in NON_OPS else 2 if c in COUNT_OPS else 1 for c in columns]


def row_is_bad(flags: Sequence[int], cells: Iterable[object], dtype: object = None) -> bool:
    """Whether a row with ``cells`` (one per column, ``flags`` from :func:`op_flags`) is
    non-finite: a value op NaN or infinite, or a count op above 0; never a row whose ``dtype`` is
    ``'nan'`` (the reference V1 writer's "no tensor" row). An empty cell (None) is not bad."""
    if dtype == "nan":
        return False
    for flag, cell in zip(flags, cells):
        if not flag or cell is None:
            continue
        value = float(cell)  # type: ignore[arg-type]
        if flag == 1 and not math.isfinite(value):
            return True
        if flag == 2 and (value > 0 or value != value):
            return True
    return False
