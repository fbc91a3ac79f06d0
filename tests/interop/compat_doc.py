"""The table of known differences in ``docs/compatibility.md``: read it, print it.

The table is the one whose header has an ``id`` column; each row's id is matched exactly
(backticks around it are ignored) against the ids the harness finds. A row whose ``why``
cell starts with ``**Intermittent:**`` is a difference that depends on a race inside the
reference (it says which): it may be found or not, and is never reported as gone.
"""

from __future__ import annotations

from pathlib import Path

from differ import Diff

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"


def cells(line: str) -> list[str]:
    """The cells of one markdown table row (``\\|`` inside a cell kept)."""
    body = line.strip().strip("|").replace("\\|", "\0")
    return [c.strip().replace("\0", "|") for c in body.split("|")]


def listed_ids(doc: Path = DOC) -> set[str]:
    """Ids of the known-differences table."""
    ids: set[str] = set()
    if not doc.exists():
        return ids
    column = None
    for line in doc.read_text().splitlines():
        if not line.lstrip().startswith("|"):
            column = None
            continue
        row = cells(line)
        if column is None:
            column = row.index("id") if "id" in row else -1
        elif column >= 0 and not set(line) <= set("|-: "):
            ids.add(row[column].strip("`"))
    return ids


def escape(text: str) -> str:
    """``text`` as one table cell: ``|`` escaped (read back by :func:`cells`), on one line."""
    return text.replace("\\|", "|").replace("|", "\\|").replace("\n", " ")


def table(diffs: list[Diff], known: dict[str, list[str]] | None = None) -> str:
    """``diffs`` as the doc's table; ``known`` keeps the why/document cells already written."""
    known = known or {}
    lines = ["| id | what differs (this run) | why | which document sides with trainprobe |", "|---|---|---|---|"]
    for d in diffs:
        why, doc = (known.get(d.id) or ["TODO", "TODO"])[:2]
        lines.append(f"| `{escape(d.id)}` | {escape(d.detail[:300])} | {escape(why)} | {escape(doc)} |")
    return "\n".join(lines)


def doc_rows(doc: Path = DOC) -> dict[str, list[str]]:
    """id -> the cells after the id (what differs, why, document) of the rows in the doc."""
    rows: dict[str, list[str]] = {}
    if not doc.exists():
        return rows
    for line in doc.read_text().splitlines():
        row = cells(line) if line.lstrip().startswith("|") else []
        if len(row) >= 4 and row[0].startswith("`"):
            rows[row[0].strip("`").replace("\\|", "|")] = row[1:4]
    return rows


def known_columns(doc: Path = DOC) -> dict[str, list[str]]:
    """id -> [why, document] of the rows already in the doc."""
    return {i: row[1:3] for i, row in doc_rows(doc).items()}


def known_details(doc: Path = DOC) -> dict[str, str]:
    """id -> the "what differs" cell of the rows already in the doc."""
    return {i: row[0] for i, row in doc_rows(doc).items()}


INTERMITTENT = "**Intermittent:**"


def intermittent_ids(doc: Path = DOC) -> set[str]:
    """Ids of the rows whose why cell starts with ``**Intermittent:**`` (may be absent)."""
    return {i for i, (why, _doc) in known_columns(doc).items() if why.startswith(INTERMITTENT)}


def mismatch(diffs: list[Diff], listed: set[str], intermittent: frozenset[str] | set[str] = frozenset()) -> str:
    """Empty when the ids of ``diffs`` are exactly ``listed``, less any ``intermittent`` ones
    not found; else what is new and what is gone."""
    found = {d.id: d.detail for d in diffs}
    new, gone = sorted(found.keys() - listed), sorted(listed - found.keys() - set(intermittent))
    lines = []
    if new:
        lines.append(f"{len(new)} difference(s) not in {DOC.name} (fix them, or add rows: make interop-list):")
        lines += [f"  NEW  {i}: {found[i][:200]}" for i in new]
    if gone:
        lines.append(f"{len(gone)} row(s) of {DOC.name} no longer found (remove them: make interop-list):")
        lines += [f"  GONE {i}" for i in gone]
    return "\n".join(lines)
