"""Differential test against the reference tool (``make interop``; not part of the main run).

Runs the same training scripts and tools under mindstudio-probe 26.2.0 and trainprobe and
asserts that the differences found are exactly those listed in docs/compatibility.md: a new
difference fails (fix it or list it, with why), and so does a listed one that is gone (remove
its row), unless its row says it is intermittent (a race inside the reference). ``make interop-list`` prints the table as it should be now.
"""

from __future__ import annotations

from pathlib import Path

from compat_doc import intermittent_ids, listed_ids, mismatch
from runs import collect, ref_python


def test_differences_are_exactly_the_documented_ones(tmp_path: Path) -> None:
    ref_python()  # fails, saying to run `make interop`, without the reference's interpreter
    diffs = collect(tmp_path)
    message = mismatch(diffs, listed_ids(), intermittent_ids())
    assert not message, f"outputs kept in {tmp_path}\n{message}"
