"""One read per tensor: min, max, sum and sum of squares in a single fused pass, where available.

PyTorch has no eager kernel that computes several reductions in one pass over memory, so the
eager statistics of a large tensor read it three times (``aminmax``, row sums, row norms; see
:mod:`trainprobe.backends.torch.stats`). ``torch.compile`` fuses the four reductions of
:func:`min_max_sum_sumsq` into one loop (inductor's C++ on the CPU, Triton on CUDA), which reads
each element once and accumulates the sum and the sum of squares in float64.

Selection happens at run time, once per process and key, and falls back silently (a DEBUG log
line) on any failure:

* per (device type, dtype): compile, then check the compiled pass against the eager kernels on
  test inputs (odd sizes, unaligned views, NaN, infinities, huge and tiny values, values that
  cancel): min and max must equal the eager ones exactly, the sum and the sum of squares must be
  at least as close to a float64 reference as the eager ones are (or within 1e-12 of their
  scale). Any exception (no C++ compiler, no Triton, an inductor error) means "not available".
* per (device type, dtype, size class: a power of 4 of elements), ``auto`` only: time both on
  tensors of that class, spread over at least 32 MB so that they come from memory as in a
  training step (best of 3, CPU time on the CPU, synchronised wall time on accelerators); the
  fused pass is used if it is at least 1.2x faster (``auto`` does not even try below 262,144
  elements).

The CPU float32 pass is a C kernel (:mod:`~trainprobe.backends.torch.native_stats`), built
and fully checked in a child process started when a front door starts, cached on disk, loaded
and probed in the training process (:meth:`FusedStats.prepare`, :meth:`FusedStats.step_boundary`):
nothing is compiled there, and no build runs inside a training step. The default and ``auto``
take it at a step boundary once built; ``on`` waits for it at start. ``on``/``auto`` use
``torch.compile`` for other dtypes and devices, in the first call that needs it (the dtype and
device are known only then, and dynamo compiles in the training process: see below).

How a compiled pass is called: on the CPU, inductor's compiled code directly, without dynamo's guards (about
10 µs a call instead of 40-100 µs; :func:`_direct_pass`), which makes it faster than the eager
kernels from 4,096 elements up. Elsewhere, through ``torch.compile``: compilation never happens
inside a compiled region (``torch.compiler.is_compiling()``: the eager kernels run), and after the
checks the compiled pass runs under the ``fail_on_recompile`` stance: a tensor that would need
another compilation takes the eager kernels instead, so the compile cost is paid once per dtype.

Mode, from the environment variable ``TRAINPROBE_FUSED_STATS`` (read when a monitor, the dump or the
metrics start, see :meth:`FusedStats.refresh`):

* unset: ``on`` on the CPU for float32, the C kernel loaded when a monitor starts if a child
  process built it earlier (milliseconds), else built aside and used from a step boundary on
  (other dtypes keep the eager kernels); ``off`` on accelerators until the pass is measured on one;
* ``auto``: use the fused pass where it is exact and faster (timed in the first call that needs
  it; CPU float32: the C kernel, built aside from start as in the default, from a step boundary
  on; others: compiled in the first call that needs them);
* ``on``: use it where it compiles and is exact, whatever its speed, so that every value of the
  run comes from the same kernels (CPU float32: a cold start waits for the C kernel's build;
  others: compiled in the first call that needs them);
* ``off``: never compile.

Statistics are never cached: only compiled code is. Every call reads the tensor as it is now.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainprobe.backends.torch import native_stats
from trainprobe.engine.errors import ConfigError

FUSED_ENV = "TRAINPROBE_FUSED_STATS"
MODES = ("auto", "on", "off")
DEFAULT_MODE: dict[str, str] = {"cpu": "on", "cuda": "off"}
"""The mode when the environment variable is unset, per device type; others get ``off``.

CPU: the default's pass is a C kernel for float32, faster than the eager statistics from 4,096
elements up (docs/performance.md, "Fused single pass", "Start-up"), built in a child process and
loaded at start or at a step boundary (:meth:`FusedStats.prepare`): no compilation in the training
process, where dynamo would raise ``torch.compiler.is_compiling()`` for the whole process (user
code and the module monitor read it) and inductor's import alone takes seconds. Other dtypes keep
the eager kernels.

CUDA: ``off``, the eager reductions (``aminmax``, a float64-accumulating sum and norm: three
reads of the tensor, no host synchronisation), by choice until measured. On a GPU the statistics
are memory-bound and run on the device while the host goes on, and the fused pass would go
through dynamo (40-100 µs of host time per call, more than a small tensor's eager statistics)
and compile once per dtype; whether one read instead of three pays for that has not been
measured on a GPU yet. ``TRAINPROBE_FUSED_STATS=auto`` (or ``on``) uses it, and
``bench/bench_fused_stats.py --device cuda`` / ``bench/bench_paired.py --device cuda
--fused-stats auto`` measure it (docs/performance.md, "GPU")."""

MIN_SPEEDUP = 1.2
_SMALLEST = 1 << 12
_AUTO_SMALLEST = 1 << 18
"""``auto`` neither compiles nor times for smaller tensors: through dynamo (accelerators) a
compiled call costs a fixed 40-100 µs, more than their eager statistics (on the CPU the direct
call is cheaper, and ``on``, the CPU default, uses the pass from :data:`_SMALLEST`)."""
_TIMING_BYTES = 32 << 20
_TIMING_REPEATS = 3
_TIMING_MAX_TENSORS = 64
_TIMING_MAX_ELEMENTS = 1 << 22

log = logging.getLogger("trainprobe.backends.torch.fused_stats")

Reductions = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
"""min and max (0-d, the tensor's dtype), sum and sum of squares (0-d float64), on its device."""


def min_max_sum_sumsq(x: torch.Tensor) -> Reductions:
    """The four reductions of a flat tensor; compiled, one pass over ``x``."""
    xd = x.to(torch.float64)
    return torch.amin(x), torch.amax(x), xd.sum(), (xd * xd).sum()


def mode_from_env(device_type: str = "cpu", value: str | None = None) -> str:
    """The mode for ``device_type``: ``TRAINPROBE_FUSED_STATS`` (or ``value``, a value of it) if
    set, else the default.

    Raises:
        ConfigError: the variable holds something other than auto, on or off.
    """
    raw = (os.environ.get(FUSED_ENV, "") if value is None else value).strip().lower()
    if not raw:
        return DEFAULT_MODE.get(device_type, "off")
    if raw not in MODES:
        raise ConfigError(f"{FUSED_ENV}={raw!r}: must be one of {', '.join(MODES)} (or unset for the default)")
    return raw


def size_class(n: int) -> int:
    """The size class of a tensor of ``n`` elements: ``floor(log4(n))``."""
    return (n.bit_length() - 1) // 2


class FusedStats:
    """Chooses, per device type, dtype and size class, between the fused pass and the eager kernels.

    Args:
        eager: the eager kernels, returning the same four values (the reference for exactness
            and speed).
        mode: ``auto``, ``on`` or ``off``; None reads :data:`FUSED_ENV` per device type.
        kernel: the function to compile (tests pass one that fails).
        compile_fn: the compiler (``torch.compile``; tests pass one that raises). When None, on
            the CPU the pass is called directly (:func:`_direct_pass`), else through dynamo.
        min_speedup: how much faster than ``baseline`` the fused pass must be in ``auto`` mode.
        baseline: what the fused pass replaces, timed against it in ``auto`` mode (default
            ``eager``; the statistics pass their fastest eager path).
    """

    def __init__(
        self,
        eager: Callable[[torch.Tensor], Reductions],
        mode: str | None = None,
        kernel: Callable[[torch.Tensor], Reductions] = min_max_sum_sumsq,
        compile_fn: Callable[..., Callable[[torch.Tensor], Reductions]] | None = None,
        min_speedup: float = MIN_SPEEDUP,
        baseline: Callable[[torch.Tensor], object] | None = None,
    ) -> None:
        assert mode is None or mode in MODES, mode
        self._eager = eager
        self._baseline = baseline or eager
        self._mode = mode
        self._kernel = kernel
        self._compile_fn = compile_fn
        self._min_speedup = min_speedup
        self._passes: dict[tuple[str, torch.dtype], _Pass | None] = {}
        self._chosen: dict[tuple[str, str, torch.dtype, int], bool] = {}
        self._lock = threading.Lock()
        self._env = os.environ.get(FUSED_ENV, "")
        self._env_modes: dict[str, str] = {}
        self._build: native_stats.Build | None = None
        self._build_started = 0.0
        self._native_failed = False

    def __call__(self, x: torch.Tensor) -> Reductions | None:
        """The four reductions of ``x`` in one pass, or None: use the eager kernels.

        ``x`` is a dense floating-point tensor; empty, small (< 4,096 elements; < 262,144 in
        ``auto`` mode), non-contiguous tensors and calls inside a compiled region get None.
        """
        n = x.numel()
        if n < _SMALLEST or not x.is_contiguous() or torch.compiler.is_compiling():
            return None
        mode = self.mode(x.device.type)
        if mode == "off" or (mode == "auto" and n < _AUTO_SMALLEST):
            return None
        key = (mode, x.device.type, x.dtype, size_class(n))
        chosen = self._chosen.get(key)
        if chosen is None:
            if key[1:3] not in self._passes and self._awaits_boundary(key[1], key[2]):
                return None  # nothing is built or compiled inside a step in these cases
            with self._lock:
                chosen = self._choose(key, x)
        if not chosen:
            return None
        fused = self._passes[key[1:3]]
        assert fused is not None
        try:
            if fused.direct:  # no dynamo, so no recompilation to refuse
                return fused.run(x)
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                return fused.run(x)
        except Exception as e:  # noqa: BLE001 - a recompile refused, or a fault: the eager kernels
            self._chosen[key] = False  # for this size class from now on, without another try
            log.debug("fused statistics: eager kernels for %s tensors of ~4^%d elements (%s)", x.dtype, key[3], e)
            return None

    def mode(self, device_type: str) -> str:
        """The mode that applies to tensors on ``device_type`` (from the environment variable as
        it was when this selector was made or last refreshed, see :meth:`refresh`)."""
        if self._mode is not None:
            return self._mode
        mode = self._env_modes.get(device_type)
        if mode is None:
            try:
                mode = mode_from_env(device_type, self._env)
            except ConfigError:
                mode = "off"  # reported at start by the backend (mode_from_env); off until fixed
            self._env_modes[device_type] = mode
        return mode

    def refresh(self) -> None:
        """Read ``TRAINPROBE_FUSED_STATS`` again (a monitor starting calls this through
        :func:`~trainprobe.backends.torch.stats.shared_fused`); reading it at every call would
        cost ~2 µs a tensor."""
        env = os.environ.get(FUSED_ENV, "")
        if env != self._env:
            self._env = env
            self._env_modes = {}

    def _default_mode(self) -> bool:
        """Whether the mode is the default one (none given, the environment variable unset)."""
        return self._mode is None and not self._env.strip()

    def prepare(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        """Make the pass for ``dtype`` on ``device`` available without compiling in this process,
        where it is the C kernel of :mod:`~trainprobe.backends.torch.native_stats` (CPU,
        float32, any mode but ``off``); the front doors call this at ``start()``, before any
        training step. Does nothing elsewhere (inductor's passes are compiled at their first use)
        or when already done.

        Built earlier, the kernel is loaded and checked now (milliseconds). Else a child process
        starts building it, and:

        * default mode and ``auto``: this returns at once; the eager kernels serve until a step
          boundary (:meth:`step_boundary`) finds it built;
        * ``on``: this waits for the build (up to :data:`_BUILD_TIMEOUT_S`), so that every value
          of the run comes from the same kernel; the wait is here, at start, never inside a step.

        Without a C compiler the default keeps the eager kernels for good (``on``/``auto`` try
        inductor's pass at first use, as for other dtypes)."""
        device = torch.device(device)
        key = (device.type, dtype)
        mode = self.mode(device.type)
        if mode == "off" or key in self._passes or not _native_applies(self._kernel, self._compile_fn, dtype, device):
            return
        with self._lock:
            if key in self._passes or self._native_failed:
                return
            if self._build is None:
                path = native_stats.checked()
                if path is not None:
                    self._take_native(_native_pass(path, self._eager))
                    return
                self._build = native_stats.start_build()
                if self._build is None:
                    log.debug("fused statistics: no C compiler to build the one-read pass")
                    self._take_native(None)
                    return
                self._build_started = time.perf_counter()
            if mode == "on" and not self._default_mode():
                self._build.wait(_BUILD_TIMEOUT_S)  # `on`: one kernel for the whole run, so wait here, at start
                if not self._build.done():
                    log.debug("fused statistics: the C kernel's build took over %.0f s", _BUILD_TIMEOUT_S)
                    self._build = None
                    self._take_native(None)
                    return
            self._adopt_build()

    def step_boundary(self) -> None:
        """Between two steps: start using the pass a child process was building, if it is built
        (and passes the exactness check). Cheap when nothing is pending (one attribute read);
        the front doors call it at the end of every step (the monitors' sessions through
        :meth:`~trainprobe.backends.torch.stats.TensorStats.between_steps`, the metrics' and
        the dump's ``step()``). No hook is registered for it: nothing is left in torch when the
        tool stops, even while the build still runs (a later start adopts it)."""
        if self._build is None or not self._build.done():
            return
        with self._lock:
            self._adopt_build()

    def _adopt_build(self) -> None:
        """Take the finished build's library (lock held); a build still running is left alone."""
        build = self._build
        if build is None or not build.done():
            return
        self._build = None
        path = build.result()
        fused = _native_pass(path, self._eager) if path is not None else None
        self._take_native(fused)
        if fused is not None:
            log.info(
                "trainprobe: statistics: one-read pass for float32 on cpu built aside in %.1f s, in use from the next "
                "step (cached for later runs; TRAINPROBE_FUSED_STATS=off skips it)",
                time.perf_counter() - self._build_started,
            )
        else:
            log.debug("fused statistics: the one-read pass did not build or is not exact")

    def _take_native(self, fused: _Pass | None) -> None:
        """Use ``fused`` (the C kernel, or None: it did not load, build or check) for float32 on
        the CPU (lock held). None means the eager kernels for good in the default mode; in
        ``on``/``auto``, inductor's pass at the first call that needs one."""
        if fused is not None or self._default_mode():
            self._passes["cpu", torch.float32] = fused
        else:
            self._native_failed = True

    def _awaits_boundary(self, device_type: str, dtype: torch.dtype) -> bool:
        """Whether a call for an undecided ``(device_type, dtype)`` takes the eager kernels until a
        step boundary: in the default mode always (only :meth:`prepare` and
        :meth:`step_boundary` load a pass), else while the C kernel is being built aside."""
        if self._default_mode():
            return True
        return self._build is not None and device_type == "cpu" and dtype == torch.float32

    def _choose(self, key: tuple[str, str, torch.dtype, int], x: torch.Tensor) -> bool:
        if key in self._chosen:
            return self._chosen[key]
        mode, device_type, dtype, _ = key
        chosen = False
        if self._pass(device_type, dtype, x.device) is not None:
            chosen = mode == "on" or self._faster(key, x.device)
        self._chosen[key] = chosen
        return chosen

    def _pass(self, device_type: str, dtype: torch.dtype, device: torch.device) -> _Pass | None:
        """The compiled and checked pass for ``(device_type, dtype)``, or None (compiled once)."""
        if (device_type, dtype) not in self._passes:
            self._passes[device_type, dtype] = self._compile_and_check(dtype, device)
        return self._passes[device_type, dtype]

    def _compile_and_check(self, dtype: torch.dtype, device: torch.device) -> _Pass | None:
        started = time.perf_counter()
        if _native_applies(self._kernel, self._compile_fn, dtype, device) and not self._native_failed:
            # only without prepare() (statistics made outside a front door): built and waited for here
            path = native_stats.checked()
            if path is None:
                build = native_stats.start_build()
                path = build.result() if build is not None and build.wait(_BUILD_TIMEOUT_S) else None
            native = _native_pass(path, self._eager) if path is not None else None
            if native is not None:
                return native
        try:
            fused = _direct_pass(self._kernel, dtype, device) if self._compile_fn is None else None
            if fused is None:
                compiled = (self._compile_fn or torch.compile)(self._kernel, dynamic=True)
                fused = _Pass(lambda x: compiled(_flat_alias(x)), direct=False)
            with torch.no_grad():
                bad = _first_mismatch(fused.run, self._eager, dtype, device)
        except Exception as e:  # noqa: BLE001 - no compiler, no Triton, an inductor error: eager kernels
            log.debug("fused statistics unavailable for %s on %s: %s: %s", dtype, device.type, type(e).__name__, e)
            return None
        if bad is not None:
            log.debug("fused statistics for %s on %s not exact (%s): eager kernels", dtype, device.type, bad)
            return None
        log.debug(
            "fused statistics for %s on %s compiled (%s) and checked in %.1f s",
            dtype,
            device.type,
            "called directly" if fused.direct else "through dynamo",
            time.perf_counter() - started,
        )
        return fused

    def _faster(self, key: tuple[str, str, torch.dtype, int], device: torch.device) -> bool:
        """Whether the fused pass beats the eager kernels by ``min_speedup`` on the size class."""
        _, device_type, dtype, cls = key
        fused = self._passes[device_type, dtype]
        assert fused is not None
        try:
            with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
                eager_s, fused_s = _time_both(self._baseline, fused.run, dtype, cls, device)
        except Exception as e:  # noqa: BLE001 - never raised into training
            log.debug("fused statistics not timed for %s: %s", key, e)
            return False
        faster = eager_s >= self._min_speedup * fused_s
        log.debug(
            "fused statistics for %s on %s, ~4^%d elements: %.0f µs against %.0f µs eager: %s",
            dtype,
            device_type,
            cls,
            fused_s * 1e6,
            eager_s * 1e6,
            "fused" if faster else "eager",
        )
        return faster


_BUILD_TIMEOUT_S = 120.0
"""How long ``on`` waits at start for the C kernel's build (then inductor's pass at first use)."""


def _native_applies(
    kernel: Callable[[torch.Tensor], Reductions],
    compile_fn: Callable[..., object] | None,
    dtype: torch.dtype,
    device: torch.device,
) -> bool:
    """Whether the C kernel stands for ``kernel``: the standard kernel, no compiler given,
    float32 on the CPU."""
    return kernel is min_max_sum_sumsq and compile_fn is None and dtype == torch.float32 and device.type == "cpu"


def _native_pass(path: Path, eager: Callable[[torch.Tensor], Reductions]) -> _Pass | None:
    """The C kernel at ``path`` as a pass, if it loads and agrees with ``eager`` on a few probe
    tensors, else None. The full exactness check (:func:`_first_mismatch`, a second or more on a
    busy machine) ran in the child that built it (:mod:`.native_stats`): a library is found only
    with the marker that check writes, for this torch and thread count."""
    started = time.perf_counter()
    try:
        run = native_stats.load(path)
        split = native_stats.load(path, parallel_from=0)  # the threads' path, on small tensors
        with torch.no_grad():
            tried = ((fn, x) for fn in (run, split) for x in _probe_inputs())
            bad = next((why for fn, x in tried if (why := _mismatch(fn(x), eager(x), x)) is not None), None)
    except Exception as e:  # noqa: BLE001 - a library that does not load: the eager kernels
        log.debug("fused statistics: the C kernel %s does not load: %s: %s", path, type(e).__name__, e)
        return None
    if bad is not None:
        log.debug("fused statistics: the C kernel is not exact (%s): eager kernels", bad)
        return None
    log.debug("fused statistics: C kernel %s loaded and checked in %.3f s", path, time.perf_counter() - started)
    return _Pass(run, direct=True, native=True)


@dataclass(frozen=True, slots=True)
class _Pass:
    """A compiled and checked pass: ``run(x)`` gives the four reductions of a contiguous ``x``;
    ``direct``: it calls compiled code without dynamo (see :func:`_direct_pass`); ``native``: it
    is the C kernel of :mod:`.native_stats` (which pass serves, for the tests and benches)."""

    run: Callable[[torch.Tensor], Reductions]
    direct: bool
    native: bool = False


def _direct_pass(
    kernel: Callable[[torch.Tensor], Reductions], dtype: torch.dtype, device: torch.device
) -> _Pass | None:
    """The pass compiled by inductor and called without dynamo: CPU only, or None.

    A call through ``torch.compile`` first evaluates dynamo's guards, about 40-100 µs on the CPU,
    more than the eager kernels take on a 64K-element tensor. The kernel is one graph over one
    flat tensor whose only symbol is its length, so the guards can only ever say "this graph":
    the graph is captured with a backend that keeps inductor's compiled callable, and each call
    passes ``(length, flat alias)`` straight to it (about 10 µs). Inductor's code checks the
    sizes and strides it is given; contiguity, dtype and device are checked by the caller
    (:meth:`FusedStats.__call__` takes contiguous tensors; a pass is per device type and dtype),
    and the exactness checks that follow run through this very callable, on odd lengths and
    unaligned offsets. Inductor's internals move between releases: anything unexpected (another
    graph signature, an import or compile error) gives None, and the dynamo path is used.
    """
    if device.type != "cpu":
        return None
    try:
        from torch._inductor.compile_fx import compile_fx
    except ImportError:
        return None
    graphs: list[tuple[Callable[..., Reductions], list[object]]] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: list[object]) -> Callable[..., Reductions]:
        compiled: Callable[..., Reductions] = compile_fx(gm, example_inputs)  # type: ignore[arg-type, assignment]
        graphs.append((compiled, list(example_inputs)))
        return compiled

    sample = torch.zeros(2 * _SMALLEST + 3, dtype=dtype, device=device)
    torch.compile(_fresh_copy(kernel), dynamic=True, fullgraph=True, backend=capture)(_flat_alias(sample))
    if len(graphs) != 1:
        return None
    compiled, inputs = graphs[0]
    symbols = [isinstance(v, torch.SymInt) for v in inputs]
    if symbols == [True, False]:
        wrapped = _Pass(lambda x: compiled(x.numel(), _flat_alias(x)), direct=True)
        inner = _generated_code(compiled)
        if inner is None:
            return wrapped
        bare = _Pass(lambda x: tuple(inner([x.numel(), x.view(-1)])), direct=True)  # type: ignore[arg-type, return-value]
        probe = torch.linspace(-1.0, 2.0, 2 * _SMALLEST + 3, device=device).to(dtype)[3:]  # an offset view
        return bare if _same_results(bare, wrapped, probe) else wrapped
    if symbols == [False]:
        return _Pass(lambda x: compiled(_flat_alias(x)), direct=True)
    return None


def _fresh_copy(kernel: Callable[[torch.Tensor], Reductions]) -> Callable[[torch.Tensor], Reductions]:
    """``kernel`` with a code object of its own: dynamo keeps its compiled graphs per code object
    (at most 8), and each capture here adds one that is never looked up again."""
    code = getattr(kernel, "__code__", None)
    if code is None:
        return kernel
    fresh = types.FunctionType(
        code.replace(), kernel.__globals__, kernel.__name__, kernel.__defaults__, kernel.__closure__
    )
    return fresh  # type: ignore[return-value]


def _same_results(a: _Pass, b: _Pass, x: torch.Tensor) -> bool:
    """Whether two calls of the pass give the same four values for ``x`` (False if one raises)."""
    try:
        return all(torch.equal(u, v) for u, v in zip(a.run(x), b.run(x), strict=True))
    except Exception:  # noqa: BLE001 - another calling convention than expected: not this path
        return False


def _generated_code(compiled: object, depth: int = 8) -> Callable[[list[object]], list[torch.Tensor]] | None:
    """The ``call(args)`` function inductor generated, found inside the callable ``compile_fx``
    returned (its ``CompiledFxGraph.current_callable``), or None. Calling it skips the AOT
    runtime wrappers around it (about 10 µs a call); it takes a list ``[length, flat tensor]``
    and checks their sizes and strides itself. Inductor's internals move between releases: not
    found means the wrapped callable is used, and the exactness checks run through whichever
    is used."""
    try:
        from torch._inductor.output_code import CompiledFxGraph
    except ImportError:
        return None
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(compiled, 0)]
    while todo:
        obj, level = todo.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, CompiledFxGraph):
            call = getattr(obj, "current_callable", None)
            return call if callable(call) else None
        inside: list[object] = [getattr(obj, name, None) for name in ("__wrapped__", "__self__", "func")]
        for cell in getattr(obj, "__closure__", None) or ():
            try:
                inside.append(cell.cell_contents)
            except ValueError:  # an empty cell
                continue
        if isinstance(obj, (list, tuple)):
            inside.extend(obj)
        todo.extend((item, level + 1) for item in inside if item is not None)
    return None


def _flat_alias(x: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the elements of the contiguous ``x`` that is not a view (no copy).

    The compiled pass sees one kind of input whatever ``x`` is (a parameter, a gradient, a slice
    of a flat buffer, of any shape): dynamo guards a view on its base's size, so views of
    different tensors would each need a compilation; this alias needs two per dtype (storage
    offset 0, and 2 or more).
    """
    flat = torch.empty(0, dtype=x.dtype, device=x.device)
    return flat.set_(x.untyped_storage(), x.storage_offset(), (x.numel(),), (1,))


def _probe_inputs() -> list[torch.Tensor]:
    """Two float32 tensors for a quick check: an unaligned view of an odd length, and one
    holding NaN and infinities."""
    gen = torch.Generator().manual_seed(2)
    odd = torch.randn(4_099 + 3, generator=gen)[3:]
    bad = torch.randn(4_097, generator=gen)
    bad[5], bad[77] = math.inf, math.nan
    return [odd, bad]


def _check_inputs(dtype: torch.dtype, device: torch.device) -> list[torch.Tensor]:
    """Flat views (odd sizes and offsets included) that exercise the cases the check must cover."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(3 * 65_536 + 1_001, generator=gen, dtype=torch.float64)
    big = 1e30 if dtype == torch.float64 else float(torch.finfo(dtype).max) / 4
    tiny = float(torch.finfo(dtype).tiny) * 8
    cases = [
        base,
        base * 1e-3 + 1e3,  # a large offset: sums that carry many digits
        base - base.mean(),  # sums that cancel
        base * big,  # squares beyond float32's range
        base * tiny,  # squares below float32's range
    ]
    with_nan = base.clone()
    with_nan[12_345] = math.nan
    with_inf = base.clone()
    with_inf[777] = math.inf
    both_inf = with_inf.clone()
    both_inf[4_000] = -math.inf
    cases += [with_nan, with_inf, both_inf]
    out = [c.to(dtype=dtype, device=device) for c in cases]
    return [t[off : off + size] for t in out for off, size in ((0, t.numel()), (3, 4_099), (17, 65_536))]


def _mismatch(fused: Reductions, eager: Reductions, x: torch.Tensor) -> str | None:
    """Why ``fused`` is worse than ``eager`` for ``x`` (see the module docstring), or None."""
    f = [v.item() for v in fused]
    e = [v.item() for v in eager]
    for name, a, b in (("min", f[0], e[0]), ("max", f[1], e[1])):
        if not (a == b or (a != a and b != b)):
            return f"{name} {a!r} != {b!r}"
    xd = x.to(torch.float64)
    finite = xd.nan_to_num(0.0, 0.0, 0.0)
    refs = (xd.sum().item(), xd.square().sum().item())
    scales = (finite.abs().sum().item(), finite.square().sum().item())
    for name, a, b, ref, scale in zip(("sum", "sum of squares"), f[2:], e[2:], refs, scales, strict=True):
        if not math.isfinite(ref):
            if not (a == ref or (a != a and ref != ref)):
                return f"{name} {a!r} != {ref!r}"
            continue
        if not abs(a - ref) <= max(abs(b - ref) if math.isfinite(b) else math.inf, 1e-12 * scale):
            return f"{name} {a!r}, eager {b!r}, float64 {ref!r}"
    return None


def _first_mismatch(
    fused: Callable[[torch.Tensor], Reductions],
    eager: Callable[[torch.Tensor], Reductions],
    dtype: torch.dtype,
    device: torch.device,
) -> str | None:
    for x in _check_inputs(dtype, device):
        why = _mismatch(fused(x), eager(x), x)
        if why is not None:
            return f"{x.numel()} elements: {why}"
    return None


def _clock(device: torch.device) -> float:
    """Seconds: the process's CPU time for CPU tensors (what the statistics take from training,
    and robust to other processes on a shared machine), wall time after a sync on accelerators."""
    if device.type == "cpu":
        return time.process_time()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _time_both(
    eager: Callable[[torch.Tensor], object],
    fused: Callable[[torch.Tensor], Reductions],
    dtype: torch.dtype,
    size_class_: int,
    device: torch.device,
) -> tuple[float, float]:
    """Best-of-3 seconds (:func:`_clock`) per tensor of the eager kernels and the fused pass, on tensors of about
    ``1.5 * 4**size_class_`` elements (at most 4M) spread over 32 MB (from memory, not from cache)."""
    n = min(max(_SMALLEST, 3 << (2 * size_class_ - 1)), _TIMING_MAX_ELEMENTS)
    count = max(2, min(_TIMING_MAX_TENSORS, _TIMING_BYTES // (n * torch.finfo(dtype).bits // 8)))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(n, generator=gen).to(dtype=dtype, device=device).view(-1) for _ in range(count)]
    best = [math.inf, math.inf]
    for _ in range(_TIMING_REPEATS):
        for which, fn in enumerate((eager, fused)):
            started = _clock(device)
            for x in xs:
                fn(x)
            best[which] = min(best[which], (_clock(device) - started) / count)
    return best[0], best[1]
