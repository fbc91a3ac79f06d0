"""Text from files made safe to print on a terminal.

Module, parameter and file names come from the model and the run folder, which trainprobe does
not control. A name holding ESC, CR or BEL could move the cursor, clear the screen or rewrite a
line already printed (a crafted name once made ``diagnose`` show "no anomaly" while it exited
1). Every name a command prints goes through :func:`printable` first.

Standard library only.

Example::

    >>> printable("layer\\x1b[2K\\rno anomaly")
    'layer\\\\x1b[2K\\\\rno anomaly'
"""

from __future__ import annotations


def _escape(char: str) -> str:
    return char.encode("unicode_escape").decode("ascii") if len(char) == 1 else char


def printable(text: object) -> str:
    """``str(text)`` with every character that is not printable (C0 and C1 controls, DEL, line
    and paragraph separators, lone surrogates, other non-printing code points) written as its
    Python escape (``\\x1b``, ``\\r``, ``\\u2028``); printable text, including non-ASCII
    letters, is kept as it is."""
    value = str(text)
    if value.isprintable():
        return value
    return "".join(c if c.isprintable() else _escape(c) for c in value)
