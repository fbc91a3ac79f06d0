"""The one table printer of the command-line tools (``query``, ``diff``, ``anomaly-analyse``,
``diagnose``): aligned columns, two spaces apart, each line's trailing blanks dropped; every cell
and column name goes through :func:`~trainprobe.engine.printable.printable` first, so that a name
read from a run (a module called ``"x\\x1b[2K\\rno anomaly"``) is shown escaped and can never move
the cursor or rewrite a line already printed.

* :func:`format_table`: a whole table as text (a header, a line of dashes unless ``rule`` is
  False, one line per row);
* :class:`StreamedTable`: a table printed batch by batch as its rows arrive (the widths are
  those of the first batch; a later, longer cell widens its line only), for results that do not
  fit in memory;
* :func:`rich_table`: the same cells drawn with ``rich`` (on a terminal, when it is installed).

Standard library only (``rich`` imported only by :func:`rich_table`).

Example::

    >>> print(format_table(("step", "name"), [(3, "fc1\\x1b[2K")]))
    step  name
    ----  -----------
    3     fc1\\x1b[2K
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TextIO

from trainprobe.engine.printable import printable

__all__ = ["StreamedTable", "format_table", "printable", "rich_table", "table_lines"]

GAP = "  "


def _texts(row: Sequence[object]) -> list[str]:
    return [printable(cell) for cell in row]


def widths_of(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[int]:
    """Per column, the width of its widest cell (the name included)."""
    return [max([len(name), *(len(row[i]) for row in rows if i < len(row))]) for i, name in enumerate(head)]


def _line(cells: Sequence[str], widths: Sequence[int]) -> str:
    return GAP.join(cell.ljust(width) for cell, width in zip(cells, widths)).rstrip()


def table_lines(head: Sequence[object], rows: Iterable[Sequence[object]], *, rule: bool = True) -> list[str]:
    """The lines of the table of ``rows`` under the column names ``head`` (cells escaped, see the
    module docstring): the header, a line of dashes (``rule``), one line per row."""
    names = _texts(head)
    cells = [_texts(row) for row in rows]
    widths = widths_of(names, cells)
    lines = [_line(names, widths)]
    if rule:
        lines.append(_line(["-" * w for w in widths], widths))
    return lines + [_line(row, widths) for row in cells]


def format_table(head: Sequence[object], rows: Iterable[Sequence[object]], *, rule: bool = True) -> str:
    """:func:`table_lines` joined by line breaks (no final one)."""
    return "\n".join(table_lines(head, rows, rule=rule))


class StreamedTable:
    """A table written to ``out`` as its rows arrive: :meth:`write` a batch (the first one fixes
    the widths and writes the header and the dashes), :meth:`close` at the end (writes the
    header of a table without rows); ``out`` is flushed after each batch. :attr:`rows` counts
    the rows written."""

    def __init__(self, out: TextIO, head: Sequence[object]) -> None:
        self.out = out
        self.names = _texts(head)
        self.widths: list[int] | None = None
        self.rows = 0

    def _start(self, cells: Sequence[Sequence[str]]) -> None:
        self.widths = widths_of(self.names, cells)
        self.out.write(_line(self.names, self.widths) + "\n" + _line(["-" * w for w in self.widths], self.widths) + "\n")

    def write(self, rows: Sequence[Sequence[object]]) -> None:
        """Write one batch of rows (cells as text already, or any object: ``str`` of it), escaped."""
        cells = [_texts(row) for row in rows]
        if self.widths is None:
            self._start(cells)
        assert self.widths is not None
        self.out.write("".join(_line(row, self.widths) + "\n" for row in cells))
        self.out.flush()
        self.rows += len(rows)

    def close(self) -> None:
        """End the table (a header even when no row came); ``out`` flushed."""
        if self.widths is None:
            self._start([])
        self.out.flush()


def rich_table(head: Sequence[object], rows: Iterable[Sequence[object]], title: str, stream: TextIO) -> bool:
    """Draw the table with ``rich`` on ``stream``, as wide as its longest cell needs (a cell is
    never cut: the terminal wraps the lines instead), cells escaped as in :func:`format_table`
    and never read as markup; False when ``rich`` is not installed (nothing drawn)."""
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        return False
    table = Table(title=Text(printable(title)))
    for column in _texts(head):
        table.add_column(Text(column), no_wrap=True)
    for row in rows:
        table.add_row(*(Text(cell) for cell in _texts(row)))  # Text: names such as "op[12]" are not markup
    console = Console(file=stream)
    needed = console.measure(table, options=console.options.update(max_width=100_000)).maximum
    if needed > console.width:
        console = Console(file=stream, width=needed)
    console.print(table)
    return True
