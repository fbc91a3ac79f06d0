"""Where and how Monitor V1 writes: the run folder, tables, CSV layouts and TensorBoard tags.

* Folder: ``<MONITOR_OUTPUT_DIR>/<MonDD_HH-MM-SS>-rank<r>-<id>/`` (local time, ``id`` 8 random hex
  digits); ``MONITOR_OUTPUT_DIR`` defaults to ``./monitor_output``. With ``append_output`` the
  existing folder of this rank whose timestamp lies in the given range (inclusive) is reused; a
  rank with no folder in the range is not continued: it starts a new folder, with one warning.
* Tables (one file per window, ``<table>_<first>-<last>.csv``): ``actv``, ``actv_grad``,
  ``grad_unreduced``, ``grad_reduced``, ``exp_avg``, ``exp_avg_sq``, ``param_origin``,
  ``param_updated``, ``other`` (mg_direction, cc), ``linear_hook``, ``attention_hook`` (their own
  columns, see :mod:`trainprobe.frontdoors.monitor_v1.l2`), ``adam_update``, ``adam_ratio`` (ur_distribution).
  With ``format: tensorboard``, ur_distribution also writes the histogram tables
  ``adam_update_histogram`` and ``adam_ratio_histogram`` (TensorBoard only).
* Header: ``vpp_stage,name,step[,micro_step],<ops>,shape,dtype``; ``micro_step`` only in ``actv``,
  ``actv_grad`` and, with ``monitor_mbs_grad``, ``grad_unreduced``; ``shape,dtype`` (see
  :mod:`trainprobe.frontdoors.monitor_v1.shapes`) in every statistics table, not in the l2 tables. The
  ``name`` column has no ``<vpp_stage>:`` prefix (``vpp_stage`` is its own column): ``fc1.input``,
  ``fc1.weight``; the root module's name is empty (``.input``).
* TensorBoard tags (the spec's ``{vpp_stage}:{name}[:{micro_step}]/{rank}/{task}_{op}``):
  ``0:fc1.input:0/rank0/actv_min`` for activations (``actv_grad`` for their gradients),
  ``0:fc1.weight/rank0/<task>_<op>`` otherwise, where the task is the table except
  ``grad_unreduced`` → ``acc_grad``, ``grad_reduced`` → ``post_grad`` and mg_direction rows (in
  table ``other``) → ``mg_direction``; with ``monitor_mbs_grad`` unreduced gradients carry their
  micro-step too (``0:fc1.weight:1/rank0/acc_grad_norm``). Alerts name rows by the same tag
  without the op. Histograms: ``<name>/rank<r>/<table>``
  (``0:fc1.weight/rank0/adam_update_histogram``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from pathlib import Path

from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import make_output_folder
from trainprobe.engine.layout import V1_KEY_COLUMNS, V1_TABLES, format_stamp, parse_stamp, v1_file_name, v1_run_folder
from trainprobe.engine.log import warn_once
from trainprobe.engine.records import RowKey
from trainprobe.engine.sinks.csv_sink import TableLayout
from trainprobe.frontdoors.monitor_v1.naming import bare

OUTPUT_ENV = "MONITOR_OUTPUT_DIR"
DEFAULT_OUTPUT = "./monitor_output"
KEY_COLUMNS = V1_KEY_COLUMNS
SCOPE_TABLE = {"unreduced": "grad_unreduced", "reduced": "grad_reduced", "comm": "other", "mg_direction": "other"}
TASKS = {"grad_unreduced": "acc_grad", "grad_reduced": "post_grad"}
"""Tables whose rows carry another task name in tags (the reference's names)."""
TRAILING = ("shape", "dtype")
TABLES = V1_TABLES
HISTOGRAM_TABLES = {"adam_update": "adam_update_histogram", "adam_ratio": "adam_ratio_histogram"}
"""ur_distribution table → the table of its TensorBoard histograms."""
L2_COLUMNS = {"linear_hook": ("sr", "kernel_norm"), "attention_hook": ("entropy", "softmax_max")}
MICRO_STEP_TABLES = ("actv", "actv_grad")


def output_root() -> Path:
    """``$MONITOR_OUTPUT_DIR`` or ``./monitor_output``."""
    return Path(os.environ.get(OUTPUT_ENV) or DEFAULT_OUTPUT)


def table_of(monitor: str, key: RowKey) -> str:
    """The V1 table of a row: its scope, with gradients and collectives renamed."""
    return SCOPE_TABLE.get(key.scope, key.scope)


file_name = v1_file_name
"""``grad_reduced_0-4.csv`` (see :mod:`trainprobe.engine.layout`)."""


def columns(ops: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Value columns of every table: the configured ops, or the l2 features' own."""
    return {table: L2_COLUMNS.get(table, ops) for table in TABLES}


def layouts(
    ops: tuple[str, ...],
    ndigits: int,
    mbs_grad: bool,
    describe: Callable[[RowKey], tuple[str, ...]] | None = None,
    changed: Callable[[int], Mapping[RowKey, tuple[str, ...]]] | None = None,
) -> dict[str, TableLayout]:
    """Layout of every table (``describe`` gives the ``shape,dtype`` cells of a row, ``changed``
    those of the rows of a step whose call had other ones: see
    :class:`~trainprobe.engine.sinks.csv_sink.TableLayout`)."""
    out = {}
    for table, cols in columns(ops).items():
        micro = table in MICRO_STEP_TABLES or (table == "grad_unreduced" and mbs_grad)
        trailing = () if table in L2_COLUMNS else TRAILING
        out[table] = TableLayout(micro, cols, KEY_COLUMNS, ndigits, bare, trailing, describe, changed)
    return out


def task_tagger(rank: int, mbs_grad: bool) -> Callable[[str, RowKey], str]:
    """Tag of a row without its op (``0:fc1.input:0/rank0/actv``; see the module docstring);
    ``mbs_grad`` (``monitor_mbs_grad``) puts the micro-step in unreduced gradients' tags."""
    micro_tables = MICRO_STEP_TABLES + (("grad_unreduced",) if mbs_grad else ())

    def task_tag(table: str, key: RowKey) -> str:
        task = key.scope if key.scope == "mg_direction" else TASKS.get(table, table)
        micro = key.micro_step is not None and table in micro_tables
        name = f"{key.name}:{key.micro_step}" if micro else key.name
        return f"{name}/rank{rank}/{task}"

    return task_tag


def tag_of(rank: int, mbs_grad: bool = False) -> Callable[[str, RowKey, str], str]:
    """Tag function for TensorBoard (see the module docstring)."""

    histograms = frozenset(HISTOGRAM_TABLES.values())
    task_tag = task_tagger(rank, mbs_grad)

    def tag(table: str, key: RowKey, op: str) -> str:
        if table in histograms:
            return f"{key.name}/rank{rank}/{table}"
        return f"{task_tag(table, key)}_{op}"

    return tag


def api_key(key: RowKey) -> str:
    """Dict key of a row in ``generate_*_metrics``: ``<name>:<micro_step>`` for activations
    (rows with a micro_step), else ``<name>``."""
    return (
        key.name if key.micro_step is None or key.scope in ("reduced", "unreduced") else f"{key.name}:{key.micro_step}"
    )


def run_folder(rank: int, append_output: tuple[str, ...]) -> Path:
    """This rank's output folder (created). ``append_output`` (two validated timestamps) reuses
    this rank's existing folder whose timestamp lies in the range; when there is none the rank is
    not continued and gets a new folder, with one warning saying so.

    Raises:
        ConfigError: an ``append_output`` timestamp that is no date (``Feb30_00-00-00``); a
            folder that cannot be created (naming ``MONITOR_OUTPUT_DIR``).
    """
    root = output_root()
    if append_output:
        found = _existing(root, rank, append_output)
        if found is not None:
            return found
        warn_once(
            f"v1-append-none-{rank}",
            f"trainprobe: append_output: no folder of rank {rank} under {str(root)!r} has a timestamp between "
            f"{append_output[0]} and {append_output[1]}; this rank is not continued and writes to a new folder",
        )
    stamp = format_stamp(datetime.now().astimezone())
    return make_output_folder(root / v1_run_folder(stamp, rank, uuid.uuid4().hex[:8]), OUTPUT_ENV)


def _bound(bounds: tuple[str, ...], i: int) -> datetime:
    try:
        return parse_stamp(bounds[i])
    except ValueError as exc:
        raise ConfigError(f"append_output[{i}]: {bounds[i]!r} is not a valid timestamp ({exc})") from None


def _existing(root: Path, rank: int, bounds: tuple[str, ...]) -> Path | None:
    lo, hi = _bound(bounds, 0), _bound(bounds, 1)
    if not root.is_dir():
        return None
    for folder in sorted(root.iterdir()):
        stamp, sep, rest = folder.name.partition("-rank")
        if not sep or not folder.is_dir() or rest.split("-", 1)[0] != str(rank):
            continue
        try:
            when = parse_stamp(stamp)
        except ValueError:
            continue
        if lo <= when <= hi:
            return folder
    return None
