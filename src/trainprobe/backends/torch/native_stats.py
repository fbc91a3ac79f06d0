"""The CPU one-read pass for float32 as a small C kernel, built aside and cached on disk.

:mod:`~trainprobe.backends.torch.fused_stats` used to get its CPU loop from ``torch.compile``:
importing inductor and compiling took 4-20 s in every process that attached a tool, and it had to
happen in the training process, before training (dynamo's ``is_compiling()`` flag is process-wide,
so not on a background thread). This module gives the same loop (min, max, and float64 sum and
sum of squares in one read) as about 80 lines of C:

* **Built by the system C compiler in a child process** (``cc``, or ``$CC``; ``-O3
  -march=native -fopenmp``, then without OpenMP, then plain ``-O2``, whichever builds first),
  never in the training process: :func:`start_build` returns at once and the tool that started
  it loads the result at a step boundary (:meth:`Build.result`).
* **Cached on disk**, keyed by the source, the flags and the CPU (model and flags, so a shared
  home on other machines never loads code built for another CPU): ``$TRAINPROBE_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/trainprobe``, else ``~/.cache/trainprobe``. A later process loads it at start
  in milliseconds (:func:`cached`). Writes are atomic (a temporary name, then a rename), so
  processes building together leave one good file.
* **Called through ctypes** with the tensor's data pointer; the loop runs on torch's OpenMP
  threads (the library resolves to the ``libgomp`` torch already loaded) from
  :data:`PARALLEL_FROM` elements, one thread below.

Nothing here decides whether the kernel is used: :class:`~trainprobe.backends.torch.fused_stats.FusedStats`
checks it against the eager kernels first, as it checked the compiled pass. Without a C compiler
the statistics keep the eager kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

CACHE_ENV = "TRAINPROBE_CACHE_DIR"
PARALLEL_FROM = 1 << 17
"""Tensors of at least this many elements are split over torch's threads (OpenMP)."""
SYMBOL = "trainprobe_min_max_sum_sumsq_f32"

SOURCE = r"""
/* trainprobe: min, max, float64 sum and sum of squares of a float32 array in one read. */
#include <stdint.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define LANES 16
#define MAX_THREADS 256

static void span(const float *x, int64_t n, float *lo_out, float *hi_out, double *s_out, double *q_out) {
    float lo[LANES], hi[LANES];
    double s[LANES], q[LANES];
    for (int j = 0; j < LANES; j++) { lo[j] = INFINITY; hi[j] = -INFINITY; s[j] = 0.0; q[j] = 0.0; }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES) {
        for (int j = 0; j < LANES; j++) {
            float v = x[i + j];
            lo[j] = v < lo[j] ? v : lo[j];
            hi[j] = v > hi[j] ? v : hi[j];
            double d = (double)v;
            s[j] += d;
            q[j] += d * d;
        }
    }
    for (int j = 0; i < n; i++, j++) {
        float v = x[i];
        lo[j] = v < lo[j] ? v : lo[j];
        hi[j] = v > hi[j] ? v : hi[j];
        double d = (double)v;
        s[j] += d;
        q[j] += d * d;
    }
    float l = lo[0], h = hi[0];
    double ss = 0.0, qq = 0.0;
    for (int j = 0; j < LANES; j++) {
        l = lo[j] < l ? lo[j] : l;
        h = hi[j] > h ? hi[j] : h;
        ss += s[j];
        qq += q[j];
    }
    *lo_out = l; *hi_out = h; *s_out = ss; *q_out = qq;
}

/* minmax[0..1] = min, max (NaN if any value is NaN); sums[0..1] = sum, sum of squares. */
void trainprobe_min_max_sum_sumsq_f32(const float *x, int64_t n, int64_t parallel_from,
                                      float *minmax, double *sums) {
    float lo[MAX_THREADS], hi[MAX_THREADS];
    double s[MAX_THREADS], q[MAX_THREADS];
    int nt = 1;
#ifdef _OPENMP
    nt = omp_get_max_threads();
    if (nt > MAX_THREADS) nt = MAX_THREADS;
#endif
    if (nt < 2 || n < parallel_from) {
        nt = 1;
        span(x, n, lo, hi, s, q);
    } else {
        int64_t chunk = ((n + nt - 1) / nt + LANES - 1) / LANES * LANES;
#ifdef _OPENMP
        #pragma omp parallel for num_threads(nt) schedule(static, 1)
#endif
        for (int t = 0; t < nt; t++) {
            int64_t a = (int64_t)t * chunk, b = a + chunk;
            if (a > n) a = n;
            if (b > n) b = n;
            span(x + a, b - a, lo + t, hi + t, s + t, q + t);
        }
    }
    float l = lo[0], h = hi[0];
    double ss = s[0], qq = q[0];
    for (int t = 1; t < nt; t++) {
        l = lo[t] < l ? lo[t] : l;
        h = hi[t] > h ? hi[t] : h;
        ss += s[t];
        qq += q[t];
    }
    /* squares are never negative: their sum is NaN exactly when a value is NaN */
    if (qq != qq) { l = NAN; h = NAN; }
    minmax[0] = l; minmax[1] = h; sums[0] = ss; sums[1] = qq;
}
"""

FLAG_SETS: tuple[tuple[str, ...], ...] = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O2",),
)
"""Tried in turn by the build; the first that builds is kept (the key covers them all)."""


def cache_dir() -> Path:
    """Where built kernels are kept: ``$TRAINPROBE_CACHE_DIR``, ``$XDG_CACHE_HOME/trainprobe`` or
    ``~/.cache/trainprobe``."""
    explicit = os.environ.get(CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(xdg) if xdg else Path.home() / ".cache") / "trainprobe"


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), else what ``platform`` knows."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = sorted({line.strip() for line in text.splitlines() if line.split(":")[0].strip() in wanted})
    return "\n".join([platform.machine(), platform.processor(), *lines])


def artefact_path() -> Path:
    """The cached library for this source, these flags and this CPU (it may not exist yet)."""
    key = "\0".join([SOURCE, repr(FLAG_SETS), _cpu_identity(), sys.platform])
    digest = hashlib.sha256(key.encode()).hexdigest()[:20]
    return cache_dir() / "fused_stats" / f"min_max_sum_sumsq_f32-{digest}.so"


def compiler() -> str | None:
    """The C compiler: ``$CC`` if it names one on the PATH, else ``cc``, ``gcc`` or ``clang``."""
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name:
            found = shutil.which(name)
            if found:
                return found
    return None


def _marker(target: Path, threads: int) -> Path:
    """The file saying that ``target`` passed the exactness check with this torch and ``threads``
    threads (the threads decide how a large tensor is split, so how its sums are added)."""
    key = hashlib.sha256(f"{torch.__version__}\0{threads}".encode()).hexdigest()[:12]
    return target.with_name(f"{target.stem}.checked-{key}")


class Build:
    """A build running in a child process (the training process never compiles): the child
    compiles the library unless it exists, then checks it against the eager kernels with the
    parent's torch and thread count and, if exact, writes the marker :func:`checked` looks for.

    Attributes:
        target: where the library will be once the build succeeded.
    """

    def __init__(self, process: subprocess.Popen[bytes], target: Path, threads: int) -> None:
        self._process = process
        self.target = target
        self.threads = threads

    def done(self) -> bool:
        """Whether the child has exited (a ``waitpid`` without waiting)."""
        return self._process.poll() is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the child up to ``timeout`` seconds; whether it has exited."""
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def result(self) -> Path | None:
        """The built and checked library once the child exited, else None (still running, or
        failed: no compiler that builds it, or a kernel that is not exact)."""
        if not self.done() or self._process.returncode != 0:
            return None
        return checked(self.threads)


def start_build(threads: int | None = None) -> Build | None:
    """Start building and checking the kernel in a child process and return at once; None when
    there is no C compiler or the cache folder cannot be written. ``threads``: the thread count
    to check it with (default: torch's)."""
    cc = compiler()
    if cc is None:
        return None
    threads = threads or torch.get_num_threads()
    target = artefact_path()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        source = target.with_suffix(".c")
        tmp = source.with_name(f"{source.name}.{os.getpid()}.tmp")
        tmp.write_text(SOURCE, encoding="utf-8")
        os.replace(tmp, source)
        root = str(Path(__file__).resolve().parents[3])  # the folder holding the trainprobe package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
        marker = _marker(target, threads)
        args = [sys.executable, "-m", "trainprobe.backends.torch._native_build", cc, str(source), str(target)]
        args += [str(marker), str(threads), *(" ".join(f) for f in FLAG_SETS)]
        process = subprocess.Popen(  # noqa: S603 - our own builder and the system compiler
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
        )
    except OSError:
        return None
    return Build(process, target, threads)


def checked(threads: int | None = None) -> Path | None:
    """The library built and checked earlier for this source, CPU, torch and thread count
    (default: torch's), if there is one."""
    path = artefact_path()
    if path.is_file() and _marker(path, threads or torch.get_num_threads()).is_file():
        return path
    return None


Kernel = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


def load(path: Path, parallel_from: int = PARALLEL_FROM) -> Kernel:
    """The kernel of the library at ``path`` as a function of a contiguous float32 CPU tensor:
    min and max (0-d float32), sum and sum of squares (0-d float64), as the compiled pass gives.
    Tensors of ``parallel_from`` elements or more are split over torch's threads.

    Raises:
        OSError: the library does not load.
        AttributeError: it lacks the kernel's symbol.
    """
    lib = ctypes.CDLL(str(path))
    fn = getattr(lib, SYMBOL)
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    empty = torch.empty
    f32, f64 = torch.float32, torch.float64

    def run(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        minmax = empty(2, dtype=f32)
        sums = empty(2, dtype=f64)
        fn(x.data_ptr(), x.numel(), parallel_from, minmax.data_ptr(), sums.data_ptr())
        lo, hi = minmax.unbind()
        total, squares = sums.unbind()
        return lo, hi, total, squares

    run.library = lib  # type: ignore[attr-defined]  # kept alive with the function
    return run
