"""The shape of ``trainprobe.tools`` (issue #33, "the re-cut"): no private name imported across
modules, no import cycle at import time (each module importable alone in a fresh interpreter), no
module named like a name its package exports (``trainprobe.tools.diff`` was a module and a
function), and no SQL edited after it is built (no ``.replace`` on a finished query)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "src" / "trainprobe" / "tools"


def _modules() -> list[str]:
    out = []
    for path in sorted(TOOLS.rglob("*.py")):
        parts = path.relative_to(TOOLS.parent.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _private_imports(path: Path, base: Path = TOOLS) -> list[str]:
    """``from trainprobe... import _name`` anywhere in ``path`` (inside functions too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trainprobe"):
            found += [
                f"{path.relative_to(base)}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_private_name_is_imported_across_modules() -> None:
    found = [line for path in sorted(TOOLS.rglob("*.py")) for line in _private_imports(path)]
    assert found == []


def test_the_scan_finds_a_private_import(tmp_path: Path) -> None:
    """The scan above can fail: an import of a private name, even inside a function, is reported."""
    path = tmp_path / "sample.py"
    path.write_text("def f():\n    from trainprobe.tools.query.layer import _connect, connect\n    return _connect\n")
    assert _private_imports(path, tmp_path) == ["sample.py:2: from trainprobe.tools.query.layer import _connect"]


_IMPORT_EACH_ALONE = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "trainprobe" or m.startswith("trainprobe.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_each_tools_module_imports_alone() -> None:
    """Every module of ``trainprobe.tools`` imported first, in an interpreter holding no other
    trainprobe module: an import cycle closed at import time fails whichever module enters it
    from the wrong side. (Spark's engine modules import pyspark lazily: all are importable.)"""
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH_ALONE, *_modules()], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _packages() -> list[str]:
    return [m for m in _modules() if (TOOLS.parent.parent / Path(*m.split("."))).is_dir()]


@pytest.mark.parametrize("package", _packages())
def test_no_module_is_named_like_a_name_its_package_exports(package: str) -> None:
    module = importlib.import_module(package)
    exported = set(getattr(module, "__all__", ()))
    folder = TOOLS.parent.parent / Path(*package.split("."))
    children = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if (p / "__init__.py").exists()}
    assert exported & children == set()


_SQL_EDIT_MARKERS = ("SELECT", "FROM", "stage_sql", "select")


def test_no_sql_is_edited_after_it_is_built() -> None:
    """No ``<sql>.replace(...)`` in the tools: an SQL string (or a builder's result) edited by text
    replacement. (Quoting in :mod:`trainprobe.tools.sql.names` doubles quotes: that is building.)"""
    found = []
    for path in sorted(TOOLS.rglob("*.py")):
        if path.relative_to(TOOLS).as_posix() == "sql/names.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "replace":
                target = ast.unparse(node.func.value)
                if any(m in target for m in _SQL_EDIT_MARKERS) or target in ("text", "sql", "header", "query"):
                    found.append(f"{path.relative_to(TOOLS)}:{node.lineno}: {ast.unparse(node)[:80]}")
    assert found == []
