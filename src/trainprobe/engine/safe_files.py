"""Reading input files that a user (or a damaged run) hands to trainprobe's offline tools: one
safe opener, so that no tool hangs, runs out of memory or prints a traceback on hostile input.

The contract of :func:`read_text` (and :func:`read_bytes`):

* only a **regular file** is read (a symlink is followed to what it points at): a folder, a FIFO,
  a socket or a device such as ``/dev/zero`` is refused without being read (a FIFO is opened
  non-blocking, so the check never waits for a writer);
* with ``within`` (a folder: the monitor output a tool was given), a file that is, or is
  reached through, a link leading **outside** that folder is refused without being opened: a
  run folder that someone else can write into cannot make a tool read ``~/.ssh/id_rsa`` and
  quote its first line in an error (see docs/security.md). :func:`is_inside` is the same test
  for tools that skip such entries while looking for files;
* at most ``max_bytes`` are read; a larger file is refused;
* the bytes present when the file was opened are read, so a file still being appended to gives
  a consistent prefix;
* text is UTF-8; a leading byte-order mark (``EF BB BF``, written by spreadsheet programs and
  Windows tools) is dropped; bytes that are not UTF-8 are refused, naming the byte offset.

Every refusal is a :class:`~trainprobe.engine.errors.ConfigError` whose one-line message starts with the
file's path, so a command line prints it and exits with 2.

Also here: :func:`bounded_int`, the one parser of integers read from files and file names
(steps, ranks, stages), which keeps them inside SQLite's 64-bit range, and :func:`one_line`,
which shows text read from a file (a name in an error message, a tag in a table) on one line
without the control characters a terminal would act on.

Example::

    from trainprobe.engine.safe_files import read_text
    text = read_text(path, max_bytes=1 << 30)
"""

from __future__ import annotations

import codecs
import errno
import os
import re
import stat
from pathlib import Path

from trainprobe.engine.errors import ConfigError

#: Largest integer a step, rank or stage may be (SQLite's INTEGER is a signed 64-bit number).
INT_MAX = (1 << 63) - 1
INT_MIN = -(1 << 63)
_INT = re.compile(r"[+-]?[0-9]{1,19}")
_DIGITS = re.compile(r"[+-]?[0-9]+")
_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def describe_size(size: int) -> str:
    """``size`` bytes in the largest whole unit: ``2 GiB``, ``512 KiB``, ``12 bytes``."""
    for unit, name in _UNITS:
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def read_bytes(path: str | os.PathLike[str], *, max_bytes: int, within: str | os.PathLike[str] | None = None) -> bytes:
    """The content of the regular file ``path`` (at most ``max_bytes``); with ``within``, only
    when ``path``, every link followed, lies inside the folder ``within``.

    Raises:
        ConfigError: ``<path>: ...`` when the file is missing, unreadable, not a regular file,
            larger than ``max_bytes``, or a link leading outside ``within``. The message never
            quotes the file's content.
    """
    where = str(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags) if within is None else _open_within(path, within, flags, where)
    except FileNotFoundError:
        raise ConfigError(f"{where}: does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: is a folder, not a file") from None
    except OSError as exc:
        raise ConfigError(f"{where}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ConfigError(f"{where}: {_kind(info.st_mode)}, not a regular file; refused")
        if info.st_size > max_bytes:
            raise ConfigError(
                f"{where}: {info.st_size} bytes, more than the {describe_size(max_bytes)} this tool reads; refused"
            )
        return _read_exactly(fd, info.st_size, where)
    finally:
        os.close(fd)


def _open_within(path: str | os.PathLike[str], within: str | os.PathLike[str], flags: int, where: str) -> int:
    """Open ``path`` only if it lies inside ``within`` (see :func:`read_bytes`).

    Fast path: ``path`` named below ``within`` without ``..``: each component is opened relative
    to the one before with ``O_NOFOLLOW`` (``openat``), so no link, even one swapped in meanwhile,
    is followed. A link on the way (or a system without ``dir_fd``) takes the slow path: the
    path resolved with every link followed must lie inside ``within``, and the resolved file is
    opened with ``O_NOFOLLOW``.

    Raises:
        ConfigError: a link leading outside ``within``.
        OSError: the file cannot be opened.
    """
    nofollow = getattr(os, "O_NOFOLLOW", 0)
    base, full = os.path.abspath(within), os.path.abspath(path)  # normalised: no "..", no "//"
    inner = full[len(base) :].lstrip(os.sep) if full.startswith(base.rstrip(os.sep) + os.sep) else ""
    parts = tuple(inner.split(os.sep)) if inner else ()
    if nofollow and os.open in os.supports_dir_fd and parts:
        try:
            return _open_below(within, parts, flags | nofollow)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):  # ELOOP/EMLINK: a link on the way
                raise
    real = os.path.realpath(path)
    if not _contains(os.path.realpath(within), real):
        raise ConfigError(
            f"{where}: a link to a file outside {str(within)!r}; refused (the offline tools read only files "
            "inside the folder they are given: copy the file there instead of linking it)"
        )
    return os.open(real, flags | nofollow)


def _open_below(folder: str | os.PathLike[str], parts: tuple[str, ...], flags: int) -> int:
    """``folder/parts[0]/.../parts[-1]`` opened component by component, none followed as a link."""
    directory = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(folder, directory)  # the folder given may itself be reached through a link
    try:
        for part in parts[:-1]:
            inner = os.open(part, directory | flags & getattr(os, "O_NOFOLLOW", 0), dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def _read_exactly(fd: int, size: int, where: str) -> bytes:
    """The first ``size`` bytes of ``fd`` (fewer if the file was cut meanwhile)."""
    parts: list[bytes] = []
    left = size
    try:
        while left > 0:
            chunk = os.read(fd, min(left, 64 << 20))
            if not chunk:
                break
            parts.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read: {exc.strerror or exc}") from None
    return b"".join(parts)


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a file"


def decode_utf8(data: bytes, where: str) -> str:
    """``data`` decoded as UTF-8, a leading byte-order mark dropped.

    Raises:
        ConfigError: ``<where>: not UTF-8 text (byte 0xff at offset 12)``.
    """
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8) :]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start : exc.start + 1].hex()
        raise ConfigError(f"{where}: not UTF-8 text (byte 0x{bad} at offset {exc.start}); refused") from None


def read_text(path: str | os.PathLike[str], *, max_bytes: int, within: str | os.PathLike[str] | None = None) -> str:
    """:func:`read_bytes` then :func:`decode_utf8`: the UTF-8 text of a regular file (inside the
    folder ``within``, when given).

    Raises:
        ConfigError: see both; the message starts with the path.
    """
    return decode_utf8(read_bytes(path, max_bytes=max_bytes, within=within), str(path))


def is_inside(path: str | os.PathLike[str], folder: str | os.PathLike[str]) -> bool:
    """True when ``path``, every symbolic link on the way followed, lies inside ``folder`` (its
    links followed too: a monitor output reached through a link is fine); never raises."""
    try:
        return _contains(os.path.realpath(folder), os.path.realpath(path))
    except (OSError, ValueError):
        return False


def _contains(base: str, real: str) -> bool:
    """Whether the resolved path ``real`` lies inside (or is) the resolved folder ``base``."""
    try:
        return os.path.commonpath([real, base]) == base
    except ValueError:  # different drives (Windows)
        return False


def is_regular_file(path: Path) -> bool:
    """True when ``path`` is (or links to) a regular file; never blocks, never raises."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except (OSError, ValueError):
        return False


def bounded_int(text: str, what: str, where: str) -> int:
    """``text`` (an optional sign and 1 to 19 digits) as an int in ``[-2**63, 2**63 - 1]``.

    Raises:
        ConfigError: ``<where>: <what> '<text>' is not an integer`` or ``... is outside the
            64-bit range``.
    """
    if not _INT.fullmatch(text):
        shown = text if len(text) <= 40 else text[:40] + "..."
        if _DIGITS.fullmatch(text):
            raise ConfigError(f"{where}: {what} {shown!r} is outside the 64-bit range [-2**63, 2**63-1]")
        raise ConfigError(f"{where}: {what} {shown!r} is not an integer")
    value = int(text)
    if not INT_MIN <= value <= INT_MAX:
        raise ConfigError(f"{where}: {what} {text!r} is outside the 64-bit range [-2**63, 2**63-1]")
    return value


def one_line(text: str) -> str:
    """``text`` with line breaks and other control characters (``\\n``, ``\\x1b``, U+2028 ...)
    shown escaped, as ``repr`` shows them; printable text (spaces included) unchanged."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)
