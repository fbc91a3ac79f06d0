"""A torn CSV file read by the query layer (issue #33's target: 20 MB with one unbalanced quote read
by ``trainprobe.tools.query.layer.connect`` in at most 30 s).

Writes a V2 ``weight_grad`` CSV file of ``--mb`` MB whose last record is torn, in two variants:
``tail`` (only the last record torn) and ``quote`` (also one opening quote never closed, in the
middle of the file, which makes the rest of the file one quoted "cell"), then for each prints
the seconds of :func:`~trainprobe.tools.runs.files.torn_tail` alone and of ``connect(run)``
plus ``SELECT count(*)``, the rows read, and what ``torn_tail`` says is left out.

Usage::

    python bench/bench_torn_csv.py            # 20 MB
    python bench/bench_torn_csv.py --mb 100
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

HEADER = "vpp_stage,step,module_name,scope,micro_step,min,max,mean,norm,nans\n"


def write_file(path: Path, megabytes: float, unbalanced: bool) -> int:
    """The file (about ``megabytes`` MB, a torn last record); returns its whole rows."""
    row = "0,{step},layers.{i}.q_proj.weight,reduced,,-0.00123,0.00456,0.0001,0.0789,0\n"
    rows = []
    size = len(HEADER)
    while size < megabytes * 1e6:
        line = row.format(step=len(rows) // 100, i=len(rows) % 100)
        rows.append(line)
        size += len(line)
    if unbalanced:
        middle = len(rows) // 2
        rows[middle] = rows[middle].replace(",layers", ',"layers', 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + "".join(rows) + "0,999999,layers.0.q_proj.weight,redu")
    return len(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=20.0, help="file size in MB (default 20)")
    args = parser.parse_args()
    from trainprobe.tools.query.layer import connect
    from trainprobe.tools.runs.files import torn_tail

    for variant in ("tail", "quote"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "run" / "rank_0" / "weight_grad_step0-9.csv"
            whole = write_file(path, args.mb, unbalanced=variant == "quote")
            start = time.perf_counter()
            tail = torn_tail(path)
            scan = time.perf_counter() - start
            start = time.perf_counter()
            con = connect(path.parent.parent)
            [(rows,)] = con.execute("SELECT count(*) FROM weight_grad").fetchall()
            read = time.perf_counter() - start
            size = path.stat().st_size / 1e6
            print(
                f"{variant:5s} {size:.1f} MB, {whole} whole rows: torn_tail {scan:.3f} s, connect + count {read:.2f} s "
                f"(target <= 30 s), {rows} rows read; left out: {tail}"
            )


if __name__ == "__main__":
    main()
