"""Where the monitors write and what they name things: the one place the writers (Monitor V1,
Monitor V2, alerts) and the offline readers (``trainprobe.tools``) agree on.

Standard library only (no torch, no other trainprobe module), so the tools import it without
loading the monitors' runtime.

* Monitor V1 run folder: ``<MONITOR_OUTPUT_DIR>/<MonDD_HH-MM-SS>-rank<r>-<id>/``
  (:func:`v1_run_folder`, :data:`V1_RUN`; the timestamp in :data:`STAMP_FORMAT`, local time, no
  year); one file per table and window: ``<table>_<first>-<last>.csv`` (:func:`v1_file_name`,
  :data:`V1_FILE`) for the tables :data:`V1_TABLES`; key columns :data:`V1_KEY_COLUMNS`.
* Monitor V2: ``<output_dir>/rank_<r>/`` (:func:`v2_rank_folder`, :data:`V2_RANK`), one file
  per monitor and window: ``<monitor>_step<first>-<last>.csv`` (:func:`v2_file_name`,
  :data:`V2_FILE`) for the monitors :data:`V2_MONITORS`; key columns :data:`V2_KEY_COLUMNS`.
* Both: a ``micro_step`` column (:data:`MICRO_COLUMN`) after the keys where the table has one.
* Alerts: ``<MONITOR_OUTPUT_DIR>/anomaly_detected/rank<r>/anomaly.json``
  (:data:`ANOMALY_FOLDER`, :func:`anomaly_rank_folder`, :data:`ANOMALY_FILE`).
"""

from __future__ import annotations

import re
from datetime import datetime

STAMP_FORMAT = "%b%d_%H-%M-%S"
"""A V1 run folder's timestamp (``Dec03_21-34-40``): local time, no year."""
LEAP_YEAR = 2000
"""Timestamps carry no year: they are read as dates of a leap year, so ``Feb29`` is a date."""

V1_TABLES: tuple[str, ...] = (
    "actv",
    "actv_grad",
    "grad_unreduced",
    "grad_reduced",
    "exp_avg",
    "exp_avg_sq",
    "param_origin",
    "param_updated",
    "other",
    "linear_hook",
    "attention_hook",
    "adam_update",
    "adam_ratio",
)
"""Every table Monitor V1 writes as CSV (see :mod:`trainprobe.frontdoors.monitor_v1.output`)."""
V1_KEY_COLUMNS: tuple[str, ...] = ("vpp_stage", "name", "step")
V2_MONITORS: tuple[str, ...] = ("module", "weight_grad", "optimizer", "param", "cc")
"""The Monitor V2 monitors, in config order; each writes its own files."""
V2_KEY_COLUMNS: tuple[str, ...] = ("vpp_stage", "step", "module_name", "scope")
MICRO_COLUMN = "micro_step"
ANOMALY_DUMP_FOLDER = "anomaly_dump"
"""The folder inside a run (V2 ``output_dir``, V1 ``MONITOR_OUTPUT_DIR``) where the online rules'
``dump`` action writes its precision dumps: the tools read the run beside it, not it."""

V1_RUN = re.compile(r"(?P<stamp>[A-Z][a-z]{2}[0-9]{2}_[0-9]{2}-[0-9]{2}-[0-9]{2})-rank(?P<rank>[0-9]+)-(?P<id>.+)")
"""A V1 run folder's name (:func:`v1_run_folder`)."""
V1_FILE = re.compile(r"(?P<type>[a-z_0-9]+?)_(?P<first>[0-9]+)-(?P<last>[0-9]+)\.csv")
"""A V1 CSV file's name (:func:`v1_file_name`)."""
V2_RANK = re.compile(r"rank_(?P<rank>[0-9]+)")
"""A V2 rank folder's name (:func:`v2_rank_folder`)."""
V2_FILE = re.compile(r"(?P<type>[a-z_0-9]+?)_step(?P<first>[0-9]+)-(?P<last>[0-9]+)\.csv")
"""A V2 CSV file's name (:func:`v2_file_name`)."""
PARQUET_SUFFIX = ".parquet"
"""The suffix of a Parquet data file (``"format": "parquet"``); its name is the CSV file's with
this suffix instead of ``.csv``."""
V1_DATA_FILE = re.compile(r"(?P<type>[a-z_0-9]+?)_(?P<first>[0-9]+)-(?P<last>[0-9]+)\.(?P<ext>csv|parquet)")
"""A V1 data file's name, CSV or Parquet."""
V2_DATA_FILE = re.compile(r"(?P<type>[a-z_0-9]+?)_step(?P<first>[0-9]+)-(?P<last>[0-9]+)\.(?P<ext>csv|parquet)")
"""A V2 data file's name, CSV or Parquet."""

CC_LOG_FILE = "cc_log.json"
"""``cc_log_only``'s call sites, in the rank's folder (V2 ``rank_<r>``, V1 the run folder)."""

ANOMALY_FOLDER = "anomaly_detected"
ANOMALY_FILE = "anomaly.json"
ANOMALY_RANK = re.compile(r"rank([0-9]+)")
"""A rank folder under :data:`ANOMALY_FOLDER` (:func:`anomaly_rank_folder`)."""


def v1_run_folder(stamp: str, rank: int, run_id: str) -> str:
    """``Dec03_21-34-40-rank0-1a2b3c4d``."""
    return f"{stamp}-rank{rank}-{run_id}"


def v1_file_name(table: str, first: int, last: int, suffix: str = ".csv") -> str:
    """``grad_reduced_0-4.csv`` (``suffix`` :data:`PARQUET_SUFFIX`: ``grad_reduced_0-4.parquet``)."""
    return f"{table}_{first}-{last}{suffix}"


def v2_rank_folder(rank: int) -> str:
    """``rank_0``."""
    return f"rank_{rank}"


def v2_file_name(monitor: str, first: int, last: int, suffix: str = ".csv") -> str:
    """``weight_grad_step0-9.csv`` for ``("weight_grad", 0, 9)`` (``.parquet`` with that ``suffix``)."""
    return f"{monitor}_step{first}-{last}{suffix}"


def anomaly_rank_folder(rank: int) -> str:
    """``rank0`` (the alert dump's per-rank folder under :data:`ANOMALY_FOLDER`)."""
    return f"rank{rank}"


def format_stamp(when: datetime) -> str:
    """``when`` as a run folder's timestamp (:data:`STAMP_FORMAT`)."""
    return when.strftime(STAMP_FORMAT)


def parse_stamp(text: str) -> datetime:
    """A run folder's timestamp as a date of :data:`LEAP_YEAR` (``Feb29_00-00-00`` included).

    Raises:
        ValueError: ``text`` is not such a timestamp (``Feb30_00-00-00``, ``3 Dec``).
    """
    return datetime.strptime(f"{LEAP_YEAR}{text}", f"%Y{STAMP_FORMAT}")
