"""The public API is what docs/api.md lists: every listed name imports from its listed module,
and each listed module's ``__all__`` is exactly its rows (so a name that disappears, or one made
public without a line in the page, fails here)."""

from __future__ import annotations

import importlib
import re
from collections import defaultdict
from pathlib import Path

import pytest

API_PAGE = Path(__file__).resolve().parent.parent / "docs" / "api.md"
_ROW = re.compile(r"^\| `(trainprobe[\w.]*)` \| `(\w+)` \|")


def documented(page: Path = API_PAGE) -> dict[str, set[str]]:
    """The tables of ``page`` (docs/api.md): module → the names listed for it."""
    names: dict[str, set[str]] = defaultdict(set)
    for line in page.read_text(encoding="utf-8").splitlines():
        if match := _ROW.match(line):
            names[match[1]].add(match[2])
    return dict(names)


DOCUMENTED = documented()
_NO_MINDSPORE = {"trainprobe.mindspore"}  # importing it needs a usable MindSpore


def test_the_page_lists_the_main_names() -> None:
    assert {"TrainerMonitorV2", "TrainerMon", "PrecisionDebugger", "ConfigError"} <= DOCUMENTED["trainprobe"]
    assert len(DOCUMENTED) >= 10


@pytest.mark.parametrize("module", sorted(set(DOCUMENTED) - _NO_MINDSPORE))
def test_each_public_module_exports_exactly_its_documented_names(module: str) -> None:
    check_module(module, DOCUMENTED[module])


def check_module(module: str, names: set[str]) -> None:
    """``module``'s ``__all__`` is exactly ``names`` and each of them imports."""
    loaded = importlib.import_module(module)
    assert sorted(loaded.__all__) == sorted(names), f"{module}.__all__ differs from docs/api.md"
    for name in names:
        assert getattr(loaded, name) is not None


def test_compatible_paths_are_the_same_objects() -> None:
    import trainprobe
    from trainprobe.core.monitor_v2.trainer import TrainerMonitorV2
    from trainprobe.pytorch import PrecisionDebugger, TrainerMon
    from trainprobe.pytorch.monitor.module_hook import TrainerMon as TrainerMonHook

    assert TrainerMonitorV2 is trainprobe.TrainerMonitorV2
    assert TrainerMon is TrainerMonHook is trainprobe.TrainerMon
    assert PrecisionDebugger is trainprobe.PrecisionDebugger


def test_a_missing_name_is_reported(tmp_path: Path) -> None:
    """The check itself: a page naming a name the module lacks does not pass."""
    page = tmp_path / "api.md"
    page.write_text("| `trainprobe` | `TrainerMonitorV3` | gone |\n", encoding="utf-8")
    listed = documented(page)
    assert listed == {"trainprobe": {"TrainerMonitorV3"}}
    with pytest.raises(AssertionError, match=r"trainprobe\.__all__ differs from docs/api\.md"):
        check_module("trainprobe", listed["trainprobe"])
    import trainprobe

    with pytest.raises(AttributeError, match="TrainerMonitorV3"):
        getattr(trainprobe, "TrainerMonitorV3")  # noqa: B009
