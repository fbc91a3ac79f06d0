"""A DuckDB connection locked to a run: it reads the run's files and nothing else.

Every connection a trainprobe tool opens on a run is locked once its views are made
(:func:`lock`), and user SQL (``trainprobe query``) runs on such a connection:

* it can read only the files listed (the run's data files, each as found and checked by
  :func:`~trainprobe.tools.runs.files.find_run_files`): ``read_csv('/etc/passwd')``,
  ``glob('/etc/*')``, a view over another folder are refused by DuckDB
  (``Permission Error: ... file system operations are disabled by configuration``);
* it writes nothing: ``COPY ... TO``, ``EXPORT DATABASE``, ``ATTACH`` fail the same way, except
  for the exact paths a tool writes itself (``writes``: ``diff -o``'s ``diff.csv``) and a private
  folder for spilling a large join (``spill``);
* it installs and loads no extension (``INSTALL``/``LOAD`` need the network or the disk);
* its settings are frozen (``SET enable_external_access = true`` or a new ``allowed_paths`` is
  an error), so SQL cannot undo the above.

Exporting a query's result goes through options that trainprobe writes itself
(``trainprobe query ... -o FILE``), never through SQL.

DuckDB settings used: ``allowed_paths`` (each file both as its literal path and as the
glob-escaped pattern the views name it by, see :mod:`~trainprobe.tools.sql.names`),
``allowed_directories``, ``enable_external_access = false``, ``lock_configuration = true``
(DuckDB ≥ 1.3).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainprobe.tools.sql.names import glob_literal, text


def lock(con: Any, files: Iterable[str | Path], writes: Iterable[str | Path] = (), spill: str | Path | None = None) -> None:
    """Lock ``con`` (a DuckDB connection) to reading ``files``; see the module docstring.

    Args:
        con: the connection, its views made already (views are resolved when queried, so the
            files they read must be among ``files``).
        files: the paths it may read.
        writes: paths the tool itself writes through ``con`` (``COPY`` of its own result).
        spill: a private folder DuckDB may spill to (its ``temp_directory``), or None.
    """
    paths = sorted({form for p in (*files, *writes) for form in (str(p), glob_literal(str(p)))})
    con.execute(f"SET allowed_paths = [{', '.join(text(p) for p in paths)}]")
    if spill is not None:
        con.execute(f"SET allowed_directories = [{text(str(spill).rstrip('/') + '/')}]")
    con.execute("SET enable_external_access = false")
    con.execute("SET lock_configuration = true")


def is_locked(con: Any) -> bool:
    """Whether ``con``'s settings are frozen (:func:`lock` ran on it)."""
    [(value,)] = con.execute("SELECT current_setting('lock_configuration')").fetchall()
    return bool(value)
