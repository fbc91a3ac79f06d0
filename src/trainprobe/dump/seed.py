"""``seed_all`` (fix randomness) and ``random_save`` (find where random numbers are drawn).

Both act on the whole process for the rest of its life, as the reference tool's do: the
functions they wrap stay wrapped (calling them again only updates the settings).
"""

from __future__ import annotations

import csv
import io
import os
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from trainprobe.dump.collector import call_stack
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.folders import check_output_folder, make_output_folder
from trainprobe.engine.patching import AttrPatch

_DROPOUT_FUNCTIONS = ("dropout", "dropout1d", "dropout2d", "dropout3d")
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d)
_TORCH_RANDOM = ("rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                 "bernoulli", "multinomial", "poisson")  # fmt: skip
_TENSOR_RANDOM = ("uniform_", "normal_", "bernoulli_", "random_", "exponential_", "cauchy_", "log_normal_",
                  "geometric_", "bernoulli")  # fmt: skip
_FUNCTIONAL_RANDOM = (*_DROPOUT_FUNCTIONS, "alpha_dropout", "feature_alpha_dropout", "rrelu", "gumbel_softmax")
_NUMPY_RANDOM = ("rand", "randn", "randint", "random", "uniform", "normal", "choice", "shuffle", "permutation")
_PYTHON_RANDOM = ("random", "randint", "uniform", "choice", "shuffle", "sample", "gauss")


PATCHES = AttrPatch()
"""``seed_all``'s and ``random_save``'s wrappers (installed for the rest of the process, as the
reference does; through :class:`AttrPatch` like every other patch, so a test can put back
exactly what was there)."""


class _Settings:
    seed = 1234
    rm_dropout = False
    is_enhanced = False
    patched = False


def restore_patches() -> None:
    """Put back every attribute ``seed_all`` and ``random_save`` replaced, and forget that they
    did, so that a later ``seed_all(rm_dropout=True)`` or ``random_save()`` installs its wrappers
    again (restoring :data:`PATCHES` alone left both believing theirs were in place)."""
    global _random_log
    PATCHES.restore()
    _Settings.patched = False
    _random_log = None


def seed_all(seed: int = 1234, mode: bool = False, rm_dropout: bool = False, is_enhanced: bool = False) -> None:
    """Fix the seeds of Python, NumPy and torch (and CUDA when available), optionally enable
    deterministic algorithms (``mode``), make dropout a no-op (``rm_dropout``: F.dropout*,
    nn.Dropout* created afterwards get p=0) and reseed torch before every random draw
    (``is_enhanced``: the same random call gives the same values every time).

    Raises:
        ConfigError: an argument of the wrong type or a seed outside [0, 2**32).
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed_all(seed=...): expected an integer in [0, 2**32), got {seed!r}")
    for arg, value in (("mode", mode), ("rm_dropout", rm_dropout), ("is_enhanced", is_enhanced)):
        if not isinstance(value, bool):
            raise ConfigError(f"seed_all({arg}=...): expected True or False, got {value!r}")
    os.environ["PYTHONHASHSEED"] = str(seed)
    os.environ["HCCL_DETERMINISTIC"] = str(mode)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
    if mode:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    _Settings.seed, _Settings.rm_dropout, _Settings.is_enhanced = seed, rm_dropout, is_enhanced
    if (rm_dropout or is_enhanced) and not _Settings.patched:
        _install_seed_wrappers()
        _Settings.patched = True


def _install_seed_wrappers() -> None:
    for api in _DROPOUT_FUNCTIONS:
        original = getattr(F, api)

        def dropout(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if _Settings.rm_dropout:
                if len(args) > 1:
                    args = (args[0], 0.0, *args[2:])
                else:
                    kwargs["p"] = 0.0
            return __original(*args, **kwargs)

        dropout.__wrapped__ = original  # type: ignore[attr-defined]
        PATCHES.replace(F, api, dropout)
    for cls in _DROPOUT_MODULES:
        init = cls.__init__

        def __init__(self: nn.Module, p: float = 0.5, inplace: bool = False, __init: Any = init) -> None:
            __init(self, 0.0 if _Settings.rm_dropout else p, inplace)

        PATCHES.replace(cls, "__init__", __init__)
    for api in _TORCH_RANDOM:
        original = getattr(torch, api)

        def draw(*args: Any, __original: Callable[..., Any] = original, **kwargs: Any) -> Any:
            if _Settings.is_enhanced and "generator" not in kwargs:
                torch.manual_seed(_Settings.seed)
            return __original(*args, **kwargs)

        draw.__wrapped__ = original  # type: ignore[attr-defined]
        PATCHES.replace(torch, api, draw)


# -- random_save ----------------------------------------------------------------------------
_RANDOM_SAVE_PATH = "random_save(output_path=...)"


class _RandomLog:
    """Appends one CSV row per distinct (API, call stack) to a file in ``output_path`` (created,
    with the file, at the first row)."""

    def __init__(self, output_path: Path) -> None:
        self.output_path = output_path
        self.file: Path | None = None
        self.seen: set[tuple[str, tuple[str, ...]]] = set()
        self.lock = threading.Lock()
        self.busy = threading.local()

    def write_to(self, output_path: Path) -> None:
        """From now on, write to a new file in ``output_path`` (``random_save`` called again)."""
        with self.lock:
            self.output_path, self.file = output_path, None

    def record(self, api: str, frame: Any) -> None:
        if getattr(self.busy, "on", False):
            return
        self.busy.on = True
        try:
            stack = tuple(call_stack(frame))
            key = (api, stack)
            with self.lock:
                if key in self.seen:
                    return
                self.seen.add(key)
                path = self._path()
                buf = io.StringIO()
                writer = csv.writer(buf)
                if not path.exists():
                    writer.writerow(["api_name", "stack"])
                writer.writerow([api, "\n".join(stack)])
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                try:
                    os.write(fd, buf.getvalue().encode("utf-8"))
                finally:
                    os.close(fd)
        finally:
            self.busy.on = False

    def _path(self) -> Path:
        if self.file is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else None
            who = f"rank{rank}" if rank is not None else f"proc{os.getpid()}"
            make_output_folder(self.output_path, _RANDOM_SAVE_PATH)
            self.file = self.output_path / f"random_{who}_{time.strftime('%Y%m%d%H%M%S')}.csv"
        return self.file


_random_log: _RandomLog | None = None


def random_save(output_path: str | os.PathLike[str] = "./output") -> None:
    """Record, for the rest of the process, every call of a randomness API (torch, torch.Tensor,
    torch.nn.functional, NumPy and Python ``random``) with its call stack, one row per distinct
    call site, in ``output_path/random_rank{id}_{timestamp}.csv`` (``random_proc{pid}_...``
    without a rank), columns ``api_name`` and ``stack``.

    Raises:
        ConfigError: ``output_path`` is not a path, or names a folder that cannot be created
            (the folder itself is created with the first row).
    """
    global _random_log
    if not isinstance(output_path, (str, os.PathLike)):
        raise ConfigError(f"{_RANDOM_SAVE_PATH}: expected a path, got {type(output_path).__name__}")
    folder = check_output_folder(os.fspath(output_path), _RANDOM_SAVE_PATH)
    if _random_log is not None:
        _random_log.write_to(folder)
        return
    log = _RandomLog(folder)
    _random_log = log
    for owner, label, names in (
        (torch, "torch", _TORCH_RANDOM),
        (torch.Tensor, "torch.Tensor", _TENSOR_RANDOM),
        (F, "torch.nn.functional", _FUNCTIONAL_RANDOM),
        (np.random, "numpy.random", _NUMPY_RANDOM),
        (random, "random", _PYTHON_RANDOM),
    ):
        for api in names:
            original = getattr(owner, api, None)
            if original is None:
                continue
            PATCHES.replace(owner, api, _recording(log, f"{label}.{api}", original))


def _recording(log: _RandomLog, api: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        log.record(api, sys._getframe(1))
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", api)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper
