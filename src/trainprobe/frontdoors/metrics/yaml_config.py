"""Reading a training-metrics YAML file: PyYAML's safe loader with trainprobe's config rules.

:func:`parse_yaml_config` parses the text of a config file and refuses, with a one-line
:class:`ConfigError` naming the file:

* a syntax error, reported as ``<file>:<line>:<column>: <problem>`` on one line (PyYAML's own
  message spans several lines and quotes the text);
* an integer literal of more than :data:`~trainprobe.engine.fields.MAX_INT_DIGITS` characters
  (Python would refuse to convert it with a bare ``ValueError``), naming its key and line;
* a key repeated where trainprobe reads: ``monitor_config`` or ``tensorboard`` twice at the top
  level, or any key twice inside those sections (PyYAML keeps the last one silently). The rest
  of the file is the training's own configuration, read by the trainer: its repeated keys are
  left to the trainer's loader, as the reference tool leaves them;
* nesting too deep for the parser.

The text is parsed by libyaml when PyYAML was built with it (a 16 MB file in well under a second,
where PyYAML's pure-Python parser needs ~25 s), else by the pure-Python parser; a small file
libyaml refuses is parsed again by the pure-Python one (see :data:`EXACT_BYTES`).
"""

from __future__ import annotations

from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.fields import MAX_INT_DIGITS, LongInt, check_long_ints
from trainprobe.engine.safe_files import one_line

#: The top-level sections trainprobe reads, where repeated keys are refused.
READ_SECTIONS = ("monitor_config", "tensorboard")


def parse_yaml_config(text: str, name: str) -> Any:
    """``text`` (the content of config file ``name``) parsed as YAML; see the module docstring.

    Raises:
        ConfigError: the file is not valid YAML, or breaks one of the rules above.
    """
    try:
        import yaml
    except ImportError:  # pragma: no cover - pyyaml is an extra
        raise ConfigError(
            f"config file {name!r}: reading YAML needs pyyaml (pip install trainprobe[yaml]); "
            "or pass a .json file or a dict"
        ) from None
    fast = _has_libyaml(yaml)
    error: Exception | None = None
    try:
        data = _parse(yaml, text, name, fast=fast)
    except yaml.YAMLError as exc:
        error = exc
        if fast and len(text) <= EXACT_BYTES:  # PyYAML's own verdict and message
            try:
                data, error = _parse(yaml, text, name, fast=False), None
            except yaml.YAMLError as pure:
                error = pure
    if error is not None:
        raise ConfigError(f"config file {name!r} is not valid YAML: {describe_yaml_error(error, name)}") from None
    check_long_ints(data, name)
    return data


#: Text up to this size (characters) that libyaml refuses is parsed again by PyYAML's pure-Python
#: parser (the reference's ``yaml.safe_load``), so that what is accepted and the message given are
#: exactly PyYAML's; larger text keeps libyaml's verdict (the pure parser needs ~1.6 s per MB).
EXACT_BYTES = 1 << 20


def _has_libyaml(yaml: Any) -> bool:
    return bool(getattr(yaml, "__with_libyaml__", False)) and hasattr(yaml, "CSafeLoader")


def _parse(yaml: Any, text: str, name: str, *, fast: bool) -> Any:
    """Compose, check repeated keys, construct; ``fast``: libyaml's parser (50x faster)."""
    loader = _loader_class(yaml, fast)(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_repeated_keys(node, name)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(f"config file {name!r} is nested too deeply to be a configuration") from None
    finally:
        loader.dispose()


def describe_yaml_error(exc: Exception, name: str) -> str:
    """PyYAML's error as one line: ``<name>:<line>:<column>: <problem> (<context> at line N)``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    where = f"{name}:{mark.line + 1}:{mark.column + 1}: " if mark is not None else ""
    text = f"{where}{problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context:
        at = f" that starts at line {context_mark.line + 1} column {context_mark.column + 1}" if context_mark else ""
        text += f" ({context}{at})"
    return one_line(text)


_LOADERS: dict[bool, Any] = {}


def _loader_class(yaml: Any, fast: bool) -> Any:
    """A subclass of ``yaml.CSafeLoader`` (``fast``) or ``yaml.SafeLoader`` whose integers are
    bounded in length (made once each)."""
    if fast not in _LOADERS:
        base = yaml.CSafeLoader if fast else yaml.SafeLoader

        class ConfigLoader(base):  # type: ignore[misc,valid-type]
            """The safe loader; an over-long integer becomes a :class:`LongInt` (reported later with its key)."""

        def construct_int(loader: Any, node: Any) -> Any:
            literal = str(node.value).replace("_", "").lstrip("+-")
            digits = len(literal) - (2 if literal[:2].lower() in ("0x", "0o", "0b") else 0)
            if digits > MAX_INT_DIGITS:
                return LongInt(digits, node.start_mark.line + 1)
            return yaml.SafeLoader.construct_yaml_int(loader, node)

        ConfigLoader.add_constructor("tag:yaml.org,2002:int", construct_int)
        _LOADERS[fast] = ConfigLoader
    return _LOADERS[fast]


def _check_repeated_keys(node: Any, name: str) -> None:
    """Refuse a repeated ``monitor_config``/``tensorboard`` at the top level, or a repeated key
    inside either section (see the module docstring)."""
    if getattr(node, "id", None) != "mapping":
        return
    pairs = [(k, v) for k, v in node.value if isinstance(getattr(k, "value", None), str)]
    sections = [(k, v) for k, v in pairs if k.value in READ_SECTIONS]
    _refuse_repeats([k for k, _ in sections], "", name)
    for key, value in sections:
        if getattr(value, "id", None) == "mapping":
            keys = [k for k, _ in value.value if isinstance(getattr(k, "value", None), str) and k.value != "<<"]
            _refuse_repeats(keys, key.value + ".", name)


def _refuse_repeats(keys: list[Any], prefix: str, name: str) -> None:
    seen: dict[str, int] = {}
    for key in keys:
        line = key.start_mark.line + 1
        if key.value in seen:
            raise ConfigError(
                f"config file {name!r}: {prefix}{key.value} appears twice (lines {seen[key.value]} and {line}); "
                "keep one (YAML readers keep only the last, so the first would be ignored silently)"
            )
        seen[key.value] = line
