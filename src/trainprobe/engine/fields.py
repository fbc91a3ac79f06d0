"""Typed reading of one JSON object with errors that name the field's JSON path.

Every config dialect reads its file through :class:`Section`, so that each mistake is reported
the same way: ``<json.path>: <what is wrong>; <what is accepted>``.

The one rule every dialect follows (see ``docs/security.md`` "Config files"):

* a key trainprobe implements is validated strictly;
* a key the reference tool (msProbe) accepts but trainprobe does not implement is accepted, and
  one warning per key and process says it is ignored (or what it maps to): each dialect lists
  these in its ``IGNORED`` mapping, passed to :meth:`Section.check_keys`;
* any other key is a :class:`ConfigError` with a "did you mean";
* an integer field accepts an integral float (``1e8``, ``2.0``), as JSON writers produce them.
* files are read with a bounded nesting depth: a pathologically deep file is a ConfigError
  naming the file, not a ``RecursionError``.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, overload

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import warn_once

T = TypeVar("T")
_MISSING: Any = object()


def join_path(parent: str, key: str | int) -> str:
    """JSON path of ``key`` under ``parent`` (``monitors`` + ``ops`` → ``monitors.ops``)."""
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def type_name(value: Any) -> str:
    """A JSON-flavoured name for the type of ``value``, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, (list, tuple)):
        return "a list"
    return type(value).__name__


def load_json_object(path: str | Path) -> dict[str, Any]:
    """Read a JSON file whose top level is an object.

    Raises:
        ConfigError: the file is missing, unreadable, not JSON, or not an object.
    """
    file = config_file(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except RecursionError:
        raise ConfigError(f"config file {str(file)!r} is nested too deeply to be a configuration") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {str(file)!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(file)!r} cannot be read: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(file)!r}: the top level must be a JSON object, not {type_name(data)}")
    return data


def config_object(source: object, expected: str) -> dict[str, Any]:
    """The configuration object ``source`` gives: itself when it is a dict, else the JSON file at
    the path ``source`` (see :func:`load_json_object`).

    Raises:
        ConfigError: ``source`` is neither a dict nor a path (the message starts with
            ``expected``, such as ``"config_path: expected a path to a JSON file"``), or the file
            cannot serve (see :func:`load_json_object`).
    """
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, Path)):
        return load_json_object(source)
    raise ConfigError(f"{expected}, got {type(source).__name__}")


def config_file(path: Any, what: str = "config file") -> Path:
    """``path`` as an existing regular file, or a ConfigError saying what is wrong with it.

    Raises:
        ConfigError: ``path`` is not a path, contains a NUL byte, does not exist, or is a folder.
    """
    if not isinstance(path, (str, Path)):
        raise ConfigError(f"{what}: expected a path (str or pathlib.Path), not {type(path).__name__}")
    text = str(path)
    if "\0" in text:
        raise ConfigError(f"{what} {text!r}: a path cannot contain a NUL byte")
    file = Path(path)
    try:
        if file.is_dir():
            raise ConfigError(f"{what} {text!r} is a folder; pass the path of the file inside it")
        if not file.is_file():
            raise ConfigError(f"{what} {text!r} does not exist; pass the path of a JSON file")
    except OSError as exc:  # name too long and the like
        raise ConfigError(f"{what} {text!r} cannot be used: {exc.strerror or exc}") from None
    return file


class Section:
    """A JSON object being read, with its path for error messages.

    Example:
        >>> s = Section({"ops": ["min"]}, "monitors.module")
        >>> s.str_list("ops")
        ('min',)
    """

    def __init__(self, data: Any, path: str = "", *, present: bool = True) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{path or '<top level>'}: must be an object, not {type_name(data)}")
        self.data: Mapping[str, Any] = data
        self.path = path
        self.present = present

    def where(self, key: str | int) -> str:
        """JSON path of ``key`` in this section."""
        return join_path(self.path, key)

    def fail(self, key: str | int, message: str) -> ConfigError:
        """An error about ``key``; raise it."""
        return ConfigError(f"{self.where(key)}: {message}")

    def check_keys(self, allowed: Iterable[str], ignored: Mapping[str, str] | None = None) -> None:
        """Reject keys that are not in ``allowed``, suggesting the closest known key.

        Keys in ``ignored`` (reference keys trainprobe does not implement, each with what happens
        to it) are accepted with one warning per key and process.
        """
        known = list(allowed)
        ignored = ignored or {}
        for key in self.data:
            if key in ignored and key not in known:
                where = self.where(key)
                warn_once(f"config-ignored:{where}", f"config field {where}: {ignored[key]}")
            elif key not in known:
                known = known + [k for k in ignored if k not in known]
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise self.fail(key, f"unknown field{hint or '.'} Known fields: {', '.join(known)}")

    def has(self, key: str) -> bool:
        """Whether ``key`` is present (``null`` counts as absent)."""
        return self.data.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as it is in the file (``default`` when absent or null)."""
        value = self.data.get(key)
        return default if value is None else value

    def boolean(self, key: str, default: bool) -> bool:
        """A ``true``/``false`` field."""
        value = self.raw(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, not {type_name(value)} {value!r}")
        return value

    @overload
    def integer(self, key: str, default: int, *, minimum: int | None = None) -> int: ...

    @overload
    def integer(self, key: str, default: None, *, minimum: int | None = None) -> int | None: ...

    def integer(self, key: str, default: int | None, *, minimum: int | None = None) -> int | None:
        """An integer field, optionally bounded below (``default`` when absent or null)."""
        value = self.raw(key, default)
        if value is None:
            return None
        return check_int(value, self.where(key), minimum)

    def number(self, key: str, default: float, *, positive: bool = False) -> float:
        """A finite number field (integers accepted)."""
        value = self.raw(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, not {type_name(value)} {value!r}")
        if positive and value <= 0:
            raise self.fail(key, f"must be greater than 0, got {value!r}")
        return float(value)

    def string(self, key: str, default: str) -> str:
        """A string field."""
        value = self.raw(key, default)
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, not {type_name(value)} {value!r}")
        return value

    def choice(
        self, key: str, default: str, choices: Sequence[str], *, aliases: Mapping[str, str] | None = None
    ) -> str:
        """A string field restricted to ``choices`` (case-insensitive; ``aliases`` map to choices)."""
        value = self.string(key, default)
        return check_choice(value, self.where(key), choices, aliases)

    def str_list(self, key: str) -> tuple[str, ...]:
        """A list of strings (absent → empty)."""
        value = self.raw(key, [])
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of strings, not {type_name(value)}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise ConfigError(f"{join_path(self.where(key), i)}: must be a string, not {type_name(item)} {item!r}")
        return tuple(value)

    def int_list(self, key: str, *, minimum: int | None = None, allow_scalar: bool = False) -> tuple[int, ...]:
        """A list of integers (absent → empty); with ``allow_scalar`` one integer is accepted too."""
        value = self.raw(key, [])
        if allow_scalar and not isinstance(value, list):
            return (check_int(value, self.where(key), minimum),)
        if not isinstance(value, list):
            raise self.fail(key, f"must be a list of integers, not {type_name(value)}")
        return tuple(check_int(item, join_path(self.where(key), i), minimum) for i, item in enumerate(value))

    def section(self, key: str) -> Section:
        """A nested object (absent or null → empty, with ``present`` false)."""
        return Section(self.raw(key, {}), self.where(key), present=self.has(key))


def check_int(value: Any, where: str, minimum: int | None = None) -> int:
    """``value`` as an int (an integral float such as ``1e8`` counts), or a ConfigError naming ``where``."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: must be an integer, not {type_name(value)} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")
    return value


def check_choice(value: str, where: str, choices: Sequence[str], aliases: Mapping[str, str] | None = None) -> str:
    """``value`` normalised to one of ``choices``, or a ConfigError listing them."""
    lowered = value.strip().lower()
    if aliases and lowered in aliases:
        return aliases[lowered]
    if lowered in choices:
        return lowered
    accepted = list(choices) + sorted(aliases or {})
    raise ConfigError(f"{where}: {value!r} is not one of {', '.join(accepted)}")
