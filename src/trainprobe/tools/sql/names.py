"""Every name and path that reaches generated SQL, made safe in one place.

The query layer builds SQL from parts, some of which come from the files of a run: the op
columns of a CSV header or a Parquet schema, and the files' paths. A run folder may be written
by others (a shared run directory), so none of that text is trusted:

* **Column names from files** must be plain identifiers (:data:`IDENTIFIER`: a letter or ``_``,
  then letters, digits and ``_``, at most 64 characters), and must not take the name of a
  column the views define (:data:`RESERVED`). Anything else is refused with one line naming the
  file and the column (:func:`check_columns`); monitors only ever write such names.
* **Identifiers** are double-quoted (:func:`ident`) and **text** single-quoted (:func:`text`),
  inner quotes doubled, wherever they are written into SQL, even after the check above.
* **Paths** are passed as literal file lists (:func:`file_list`): DuckDB and Spark read a path
  holding ``*``, ``?`` or ``[`` as a pattern, so those characters are escaped as one-character
  classes (``[[]``, ``[*]``, ``[?]``), and a folder named ``run[1]`` reads ``run[1]``'s files,
  never ``run1``'s.

Standard library only.

Example::

    >>> ident('we"ird')
    '"we""ird"'
    >>> glob_literal("/runs/run[1]/a*.csv")
    '/runs/run[[]1]/a[*].csv'
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from trainprobe.engine.errors import ConfigError

IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
"""What a column name read from a file must match in full."""

RESERVED: frozenset[str] = frozenset(
    {
        # the views' own columns (query.py) and the columns the readers add to a scan
        "rank", "name", "file", "file_row", "filename", "ordinality", "file_row_number",
        # the execution key and the answers' columns (query_sql.py, diagnose_sql.py, diff_sql.py)
        "x_once", "x_micro", "x_phase", "x_stage", "x_table", "x_position", "position", "stage", "tbl", "table", "op",
        "value", "median",
    }
)
"""Names a file's op column may not take: the views define columns of these names."""

_GLOB_CHARACTERS = re.compile(r"[\[*?]")
_HADOOP_GLOB_CHARACTERS = re.compile(r"[\\\[\]{}*?]")


def ident(name: str) -> str:
    """``name`` as a SQL identifier: double quotes, inner double quotes doubled."""
    return '"' + name.replace('"', '""') + '"'


def text(value: str) -> str:
    """``value`` as a SQL string literal: single quotes, inner single quotes doubled."""
    return "'" + value.replace("'", "''") + "'"


def glob_literal(path: str) -> str:
    """``path`` written so that a glob reads it as exactly this path (``[`` → ``[[]``, ``*`` →
    ``[*]``, ``?`` → ``[?]``; DuckDB's and Hadoop's globs both read a one-character class)."""
    return _GLOB_CHARACTERS.sub(lambda m: f"[{m[0]}]", path)


def hadoop_glob_literal(path: str) -> str:
    """``path`` written so that Hadoop's glob (Spark's file reader) reads it as exactly this path:
    each of ``\\ [ ] { } * ?`` escaped with a backslash (Hadoop's class syntax is Java's
    regular expressions', where ``[[]`` is not a class)."""
    return _HADOOP_GLOB_CHARACTERS.sub(lambda m: "\\" + m[0], path)


def file_list(paths: Iterable[str]) -> str:
    """A SQL list literal of ``paths``, each as a :func:`glob_literal` string."""
    return "[" + ", ".join(text(glob_literal(p)) for p in paths) + "]"


def check_columns(columns: Iterable[str], where: object, allowed: Iterable[str] = ()) -> None:
    """Refuse a file whose column names could not have been written by a monitor.

    Args:
        columns: the file's column names (a CSV header, a Parquet schema).
        where: the file, named in the message.
        allowed: reserved names this layout's files hold as keys (V1's ``name``).

    Raises:
        ConfigError: one line, ``<file>: column <name> is not a monitor column name (...)``.
    """
    keys = set(allowed)
    for column in columns:
        if not IDENTIFIER.fullmatch(column):
            shown = column.encode("unicode_escape").decode("ascii")[:80]
            raise ConfigError(
                f"{where}: column '{shown}' is not a monitor column name (letters, digits and '_', "
                "at most 64, not starting with a digit); refused, is this a monitor file?"
            )
        if column in RESERVED and column not in keys:
            raise ConfigError(
                f"{where}: column {column!r} takes the name of a column the query layer defines; refused, "
                "is this a monitor file?"
            )
