"""Print the differences found today as the table of docs/compatibility.md (``make interop-list``).

Usage: TRAINPROBE_REF_PYTHON=.venv-ref/bin/python python tests/interop/list_differences.py [OUT]

Runs the whole harness into OUT (default: a temporary folder) and prints the markdown table:
one row per difference id, with the "why" and "document" cells of rows already in the doc
kept and ``TODO`` for new ones; an intermittent row not found this time is kept as it was
(its detail cell from the doc). Paste it over the table in docs/compatibility.md.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from compat_doc import intermittent_ids, known_columns, known_details, listed_ids, table  # noqa: E402
from differ import Diff  # noqa: E402
from runs import collect  # noqa: E402


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="interop-") as tmp:
        out = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tmp)
        diffs = collect(out)
        found_ids, details = {d.id for d in diffs}, known_details()
        kept = [Diff(i, details[i]) for i in sorted(intermittent_ids() - found_ids)]
        diffs = sorted([*diffs, *kept], key=lambda d: d.id)
        print(table(diffs, known_columns()))
        found, listed = found_ids, listed_ids() - intermittent_ids()
        print(
            f"\n{len(found)} differences; new since the doc: {len(found - listed)}, "
            f"gone since the doc: {len(listed - found)}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
