"""The child process that builds and checks the C kernel of :mod:`.native_stats` (run with
``python -m``; never imported by the training process).

Arguments: compiler, source, target library, marker file, thread count, then one argument per
set of compiler flags to try in turn. Compiles the library unless it exists (to a temporary name,
then renamed: processes building together leave one good file), then imports torch, checks the
library against the eager kernels with that many threads and writes the marker if it is exact.
Exit status 0: built, checked and exact. Runs at a lower priority (``nice`` 10) than the
training process that started it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def compile_library(cc: str, source: Path, target: Path, flag_sets: list[list[str]]) -> bool:
    """Build ``target`` from ``source`` with the first flag set that works; whether it exists."""
    if target.is_file():
        return True
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    for flags in flag_sets:
        cmd = [cc, *flags, "-shared", "-fPIC", "-o", str(tmp), str(source)]
        if subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False).returncode == 0:
            os.replace(tmp, target)
            return True
    return False


def check_library(target: Path, marker: Path, threads: int) -> bool:
    """Whether the library is exact against the eager kernels (then ``marker`` is written)."""
    import torch

    from trainprobe.backends.torch import fused_stats, native_stats
    from trainprobe.backends.torch.stats import eager_reductions

    torch.set_num_threads(threads)
    run = native_stats.load(target)
    with torch.no_grad():
        bad = fused_stats._first_mismatch(run, eager_reductions, torch.float32, torch.device("cpu"))
    if bad is not None:
        print(f"not exact: {bad}", file=sys.stderr)
        return False
    tmp = marker.with_name(f"{marker.name}.{os.getpid()}.tmp")
    tmp.write_text(f"checked with torch {torch.__version__}, {threads} threads\n", encoding="utf-8")
    os.replace(tmp, marker)
    return True


def main(argv: list[str]) -> int:
    cc, source, target, marker, threads, *flags = argv
    try:
        os.nice(10)  # behind the training process it runs beside, on a busy machine
    except OSError:
        pass
    if not compile_library(cc, Path(source), Path(target), [f.split() for f in flags]):
        return 1
    return 0 if check_library(Path(target), Path(marker), int(threads)) else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
