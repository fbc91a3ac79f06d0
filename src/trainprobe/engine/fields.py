"""Typed reading of one JSON object with errors that name the field's JSON path.

Every config dialect reads its file through :class:`ConfigObject`, so that each mistake is reported
the same way: ``<json.path>: <what is wrong>; <what is accepted>``.

The one rule every dialect follows (see ``docs/security.md`` "Config files"):

* a key trainprobe implements is validated strictly;
* a key the reference tool (msProbe) accepts but trainprobe does not implement is accepted, and
  one warning per key and process says it is ignored (or what it maps to): each dialect lists
  these in its ``IGNORED`` mapping, passed to :meth:`ConfigObject.check_keys`;
* any other key is a :class:`ConfigError` with a "did you mean";
* an integer field accepts an integral float (``1e8``, ``2.0``), as JSON writers produce them.
* files are read with a bounded nesting depth: a pathologically deep file is a ConfigError
  naming the file, not a ``RecursionError``.

Reading a config file (:func:`read_config_text`, :func:`parse_json_config`; the training-metrics
YAML reader uses the first and :func:`find_long_int` too) follows these rules, each refusal a
one-line ConfigError naming the file (``docs/security.md`` "Config files"):

* a file larger than :data:`MAX_CONFIG_BYTES` (16 MiB) is refused before it is parsed;
* a key repeated in one JSON object is refused, naming the key (Python's ``json`` silently keeps
  the last one, so the value a reader of the file sees first would be ignored);
* an integer literal of more than :data:`MAX_INT_DIGITS` digits is refused, naming the key that
  holds it (Python refuses to convert it with a bare ``ValueError``).
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
from trainprobe.engine.safe_files import describe_size, read_bytes

#: Largest config file read (bytes); a configuration is a few kilobytes.
MAX_CONFIG_BYTES = 16 << 20
#: Most digits an integer literal of a config file may have (Python's own limit for ``int(str)``).
MAX_INT_DIGITS = 4300

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
    """Read a JSON config file whose top level is an object (see the module docstring).

    Raises:
        ConfigError: the file is missing, unreadable, too large, not JSON, not an object, or holds
            a repeated key or an over-long integer.
    """
    file, text = read_config_text(path)
    data = parse_json_config(text, str(file))
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(file)!r}: the top level must be a JSON object, not {type_name(data)}")
    return data


def read_config_text(path: Any, what: str = "config file") -> tuple[Path, str]:
    """``(file, text)`` of the config file ``path``: an existing regular file of at most
    :data:`MAX_CONFIG_BYTES`, read as UTF-8.

    Raises:
        ConfigError: see :func:`config_file`; or the file is too large, unreadable or not UTF-8.
    """
    file = config_file(path, what)
    name = str(file)
    try:
        size = file.stat().st_size
    except OSError as exc:
        raise ConfigError(f"{what} {name!r} cannot be read: {exc.strerror or exc}") from None
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{what} {name!r} holds {size} bytes, more than the {describe_size(MAX_CONFIG_BYTES)} a "
            "configuration may hold; refused (is it the right file?)"
        )
    try:
        raw = read_bytes(file, max_bytes=MAX_CONFIG_BYTES)
    except ConfigError as exc:
        raise ConfigError(f"{what} {name!r} cannot be read: {exc}") from None
    try:
        return file, raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {name!r} cannot be read: {exc}") from None


def parse_json_config(text: str, name: str) -> Any:
    """``text`` (the content of config file ``name``) parsed as JSON, with the module docstring's
    rules: nesting bounded, keys unique, integers of at most :data:`MAX_INT_DIGITS` digits.

    Raises:
        ConfigError: ``config file '<name>' is not valid JSON: ...``, ``... key 'x' appears twice
            in one object ...``, ``... <json.path>: an integer of 5000 digits ...``.
    """
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys, parse_int=_bounded_int)
    except RecursionError:
        raise ConfigError(f"config file {name!r} is nested too deeply to be a configuration") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"config file {name!r} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    except _RepeatedKey as exc:
        raise ConfigError(
            f"config file {name!r}: key {exc.args[0]!r} appears twice in one object; keep one "
            "(JSON readers differ on which one counts, so trainprobe refuses to guess)"
        ) from None
    check_long_ints(data, name)
    return data


class LongInt:
    """Stands for an integer literal too long to convert (see :data:`MAX_INT_DIGITS`) until
    :func:`check_long_ints` reports where it is; ``line`` is its 1-based line when known."""

    __slots__ = ("digits", "line")

    def __init__(self, digits: int, line: int | None = None) -> None:
        self.digits = digits
        self.line = line


def check_long_ints(data: Any, name: str) -> None:
    """Raise a ConfigError naming the key path of the first :class:`LongInt` in ``data``.

    The walk is iterative (a deep document cannot overflow the stack) and visits each shared
    object (a YAML alias) once.
    """
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(data, "")]
    while stack:
        value, where = stack.pop()
        if isinstance(value, LongInt):
            line = f" (line {value.line})" if value.line is not None else ""
            raise ConfigError(
                f"config file {name!r}: {where or '<top level>'}{line}: an integer of {value.digits} digits is "
                f"longer than the {MAX_INT_DIGITS} digits a configuration may hold; refused"
            )
        if not isinstance(value, (dict, list)) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, LongInt):
                    stack.append((key, join_path(where, "<integer key>")))
                else:
                    stack.append((item, join_path(where, str(key))))
        else:
            stack.extend((item, join_path(where, i)) for i, item in enumerate(value))


def _bounded_int(text: str) -> int | LongInt:
    digits = len(text) - (text[:1] in "+-")
    return int(text) if digits <= MAX_INT_DIGITS else LongInt(digits)


class _RepeatedKey(ValueError):
    pass


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _RepeatedKey(key)
        out[key] = value
    return out


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


class ConfigObject:
    """A JSON object being read, with its path for error messages.

    Example:
        >>> s = ConfigObject({"ops": ["min"]}, "monitors.module")
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

    def section(self, key: str) -> ConfigObject:
        """A nested object (absent or null → empty, with ``present`` false)."""
        return ConfigObject(self.raw(key, {}), self.where(key), present=self.has(key))


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
