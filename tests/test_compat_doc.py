"""docs/compatibility.md's table of known differences stays a table: every row has its four
cells (a ``|`` inside a cell is escaped), and ``make interop-list`` writes the rows it keeps
so that they read back unchanged (tests/interop/compat_doc.py; no reference tool needed)."""

from __future__ import annotations

import sys
from pathlib import Path

INTEROP = Path(__file__).resolve().parent / "interop"
sys.path.insert(0, str(INTEROP))

from compat_doc import DOC, cells, doc_rows, table  # noqa: E402
from differ import Diff  # noqa: E402


def test_every_row_of_the_known_differences_table_has_four_cells() -> None:
    text = DOC.read_text(encoding="utf-8")
    known = text[text.index("\n## Known differences") :]  # the table make interop-list writes (other tables have their own columns)
    rows = [line for line in known.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    bad = [line[:120] for line in rows if len(cells(line)) != 4]
    assert not bad, bad
    for line in rows:
        _id, detail, why, document = cells(line)
        assert why.strip() and why != "TODO" and document.strip(), line[:120]


def test_listed_rows_keep_their_pipes_when_the_table_is_written_again(tmp_path: Path) -> None:
    why = "a magnitude difference `|a-b| / (max(|a|,|b|) + floor)` above 0.5 warns"
    doc = tmp_path / "compatibility.md"
    first = table(
        [Diff("cross/x: verdicts", "reference {'pass': 1} | trainprobe {}")], {"cross/x: verdicts": [why, "spec"]}
    )
    doc.write_text(first + "\n", encoding="utf-8")
    rows = doc_rows(doc)
    assert rows["cross/x: verdicts"] == ["reference {'pass': 1} | trainprobe {}", why, "spec"]
    again = table(
        [Diff("cross/x: verdicts", "reference {'pass': 1} | trainprobe {}")],
        {"cross/x: verdicts": rows["cross/x: verdicts"][1:]},
    )
    assert again == first
