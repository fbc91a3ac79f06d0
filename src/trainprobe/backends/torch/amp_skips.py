"""Optimizer steps that ``GradScaler`` skips.

When a scaled backward produced inf or NaN gradients, ``GradScaler.step(optimizer)`` does not call
``optimizer.step()``. A monitored step ends in the optimizer's step hooks, so without help that
iteration would never end: the next iteration's rows would join it under the same step number
and its backward-end rows would be lost. While a monitor listens (:func:`watch_skipped_steps`),
``GradScaler.step`` is wrapped at class level (``torch.amp.GradScaler`` and any subclass or older
class defining its own ``step``); when it returns without the watched optimizer having stepped,
the listener's callback ends the step, so the skipped iteration keeps its own step number and its
rows (the gradients that held the inf) are written. Before the callback runs, the listener's
``last_scale`` holds the scaler's scale that overflowed (read on skipped steps only: the scaler
has synchronised with the device for its inf check already), so that the monitor can label the
step (:mod:`trainprobe.engine.skip_log`). The last listener to leave restores the exact originals.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from trainprobe.backends.torch.optimizer import TorchOptimizerView, innermost_optimizer
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.log import error_once
from trainprobe.engine.patching import AttrPatch


def _scaler_classes() -> list[type]:
    """The GradScaler classes of this PyTorch that define ``step`` themselves."""
    found = []
    for owner, name in ((torch.amp, "GradScaler"), (torch.cuda.amp, "GradScaler"), (torch.cpu.amp, "GradScaler")):
        cls = getattr(owner, name, None)
        if isinstance(cls, type) and "step" in vars(cls) and cls not in found:
            found.append(cls)
    return found


class SkipWatch:
    """One listener: calls ``on_skip()`` when ``GradScaler.step`` skips ``optimizer``'s step
    (a view's last optimizer, the one that is last now when the view followed a replaced one)."""

    def __init__(self, optimizer: Any, on_skip: Callable[[], None]) -> None:
        self._watched = optimizer
        self.on_skip = on_skip
        self.steps = 0
        self.last_scale: float | None = None
        self._hook = optimizer.register_step_post_hook(self._count)

    @property
    def optimizer(self) -> Any:
        """The torch optimizer whose steps are counted now."""
        watched = self._watched
        return watched.optimizers[-1] if isinstance(watched, TorchOptimizerView) else watched

    def _count(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1

    def remove(self) -> None:
        """Stop listening (the last listener restores ``GradScaler.step``)."""
        self._hook.remove()
        with _LOCK:
            if self in _LISTENERS:
                _LISTENERS.remove(self)
                if not _LISTENERS:
                    _restore()


_LISTENERS: list[SkipWatch] = []
_PATCH = AttrPatch()
_LOCK = threading.Lock()


def watch_skipped_steps(optimizer: Any, on_skip: Callable[[], None]) -> SkipWatch | None:
    """Call ``on_skip()`` whenever a ``GradScaler.step(opt)`` with ``opt`` (or a wrapper of it)
    returns without ``optimizer`` having stepped. Returns the listener (``remove()`` it at stop),
    or None for an optimizer that is not a ``torch.optim.Optimizer`` (no GradScaler steps it).
    For a :class:`~trainprobe.backends.torch.optimizer.TorchOptimizerView`, the last of its
    optimizers is watched (the one whose step ends the step; its replacement once the view
    follows one)."""
    if not isinstance(optimizer, (torch.optim.Optimizer, TorchOptimizerView)):
        return None
    watch = SkipWatch(optimizer, on_skip)
    with _LOCK:
        if not _LISTENERS:
            _install()
        _LISTENERS.append(watch)
    return watch


def _install() -> None:
    for cls in _scaler_classes():
        _PATCH.replace(cls, "step", _wrap(vars(cls)["step"]))


def _restore() -> None:
    _PATCH.restore()


def _wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        watching = _watching(optimizer)
        before = [w.steps for w in watching]
        result = original(scaler, optimizer, *args, **kwargs)
        for watch, steps in zip(watching, before):
            if watch.steps == steps:
                try:
                    watch.last_scale = _scale_of(scaler)
                    watch.on_skip()
                except Exception as exc:  # noqa: BLE001 - never raise into training
                    error_once(f"amp-skip-{id(watch)}", f"trainprobe: ending a skipped step failed: {exc!r}")
        return result

    functools.update_wrapper(step, original)  # name, doc, __wrapped__
    return step


def _scale_of(scaler: Any) -> float | None:
    """The scaler's current scale (before its ``update()``), or None when it cannot be read."""
    try:
        return float(scaler.get_scale())
    except Exception:  # noqa: BLE001 - a scaler of another kind: the skip is still labelled
        return None


def _watching(optimizer: Any) -> list[SkipWatch]:
    try:
        inner = innermost_optimizer(optimizer)
    except ConfigError:
        return []
    with _LOCK:
        return [w for w in _LISTENERS if w.optimizer is inner or w.optimizer is optimizer]
