"""How ``trainprobe diff`` matches the rows of two runs: the key, the built-in name normalisation
and the user's ``--map`` file (standard library only; the SQL runs in DuckDB).

Rows are matched on ``(table, rank, step, micro_step, vpp_stage, name, scope)`` after:

* ``vpp_stage``: a negative chunk (the reference's V2 writes -1 without chunks) counts as 0;
* ``micro_step``: NULL (a table without micro-batches) counts as -1 on both sides; a table whose
  ``micro_step`` is empty in one run (the reference's V2 ``module`` CSV has no such column,
  trainprobe's has) is matched without it;
* ``name`` (both runs): a V1 ``<chunk>:`` prefix removed (``0:layers.0`` → ``layers.0``), every
  wrapper part removed wherever it is (``_orig_mod.`` of ``torch.compile``,
  ``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``) and leading ``module.`` parts
  (DDP, Megatron's ``Float16Module``) removed;
* then the candidate's names only: the ``--map`` pairs, in file order, each a regular expression
  (RE2 syntax, as DuckDB's ``regexp_replace``; groups ``\\1``; on Spark Java's, the groups translated by
  :func:`trainprobe.tools.engines.spark.to_spark`) replaced everywhere in the name.

A map file is YAML or JSON: either a mapping ``{pattern: replacement, ...}`` (its order is kept)
or a list of ``[pattern, replacement]`` pairs; either may sit under a top-level ``map`` key.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainprobe.engine.errors import ConfigError
from trainprobe.tools.sql.names import text as literal

WRAPPER_PARTS: tuple[str, ...] = ("_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
"""Name parts that wrappers insert and that carry no meaning for a comparison."""

Mapping = list[tuple[str, str]]
"""Ordered ``(pattern, replacement)`` pairs applied to the candidate's names."""


def normalised_name_sql(column: str = "name", mapping: Sequence[tuple[str, str]] = ()) -> str:
    """SQL for the normalised ``column`` (see the module docstring), then ``mapping`` applied."""
    expr = f"regexp_replace({column}, '^[0-9]+:', '')"
    wrappers = "|".join(part.replace(".", "\\.") for part in WRAPPER_PARTS)
    expr = f"regexp_replace({expr}, '(^|\\.)({wrappers})+', '\\1', 'g')"
    expr = f"regexp_replace({expr}, '^(module\\.)+', '')"
    for pattern, replacement in mapping:
        expr = f"regexp_replace({expr}, {literal(pattern)}, {literal(replacement)}, 'g')"
    return expr


def key_sql(step_offset: int = 0, mapping: Sequence[tuple[str, str]] = (), micro: bool = True,
            by_name: bool = False) -> str:
    """The SELECT list of the match key over a view's columns (``k_*`` columns); without
    ``micro``, ``micro_step`` is left out of the key (-1 for every row); with ``by_name`` (two
    pipeline splits) rank and stage are not (0 for every row): a tensor is matched by its
    global name alone."""
    step = f"step + {int(step_offset)}" if step_offset else "step"
    rank, vpp = ("0", "0") if by_name else ("rank", "greatest(COALESCE(vpp_stage, 0), 0)")
    return (
        f"{rank} AS k_rank, {step} AS k_step, {'COALESCE(micro_step, -1)' if micro else '-1'} AS k_micro, "
        f"{vpp} AS k_vpp, {normalised_name_sql('name', mapping)} AS k_name, "
        "scope AS k_scope"
    )


KEY = ("k_rank", "k_step", "k_micro", "k_vpp", "k_name", "k_scope")
"""The match key's columns."""


def load_mapping(path: str | Path) -> Mapping:
    """The ``(pattern, replacement)`` pairs of a ``--map`` file (YAML or JSON, see the module
    docstring).

    Raises:
        ConfigError: the file cannot be read or parsed, or is not such a mapping (the message
            names the file and says what is expected).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--map: cannot read {path}: {exc}") from None
    data: Any
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--map: {path} is not valid JSON: {exc}") from None
    else:
        try:
            import yaml
        except ImportError:
            raise ConfigError("--map: a YAML file needs pyyaml (pip install 'trainprobe[yaml]'), or give JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"--map: {path} is not valid YAML: {' '.join(str(exc).split())}") from None
    return parse_mapping(data, str(path))


def parse_mapping(data: Any, where: str = "mapping") -> Mapping:
    """``data`` (a parsed map file, or a dict/list given from Python) as ordered pairs."""
    if isinstance(data, dict) and set(data) == {"map"}:
        data = data["map"]
    pairs: Mapping = []
    if isinstance(data, dict):
        items: list[Any] = list(data.items())
    elif isinstance(data, list):
        items = data
    else:
        raise ConfigError(
            f"--map: {where} must be a mapping {{pattern: replacement}} or a list of [pattern, replacement] pairs, "
            f"got {type(data).__name__}"
        )
    for i, item in enumerate(items):
        if not (isinstance(item, (list, tuple)) and len(item) == 2 and all(isinstance(x, str) for x in item)):
            raise ConfigError(f"--map: {where}: entry {i} must be a pattern and a replacement (two strings), got {item!r}")
        pairs.append((item[0], item[1]))
    return pairs


def check_mapping(engine: Any, mapping: Sequence[tuple[str, str]]) -> None:
    """Each pattern compiled once by the engine that will apply it (its ``fetch(sql)``: DuckDB's
    or Spark's, :mod:`trainprobe.tools.engines.base`), so that a bad one is a ConfigError naming it."""
    for pattern, replacement in mapping:
        try:
            engine.fetch(f"SELECT regexp_replace('x', {literal(pattern)}, {literal(replacement)}, 'g')")
        except Exception as exc:  # noqa: BLE001 - the engine's errors: one message for the user
            raise ConfigError(f"--map: pattern {pattern!r}: {' '.join(str(exc).split())[:200]}") from None
