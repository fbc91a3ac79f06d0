"""Level L1 (and mix): API calls.

Every API of the catalog (``torch.*``, ``torch.nn.functional.*``, ``torch.Tensor`` methods and
Python operators, ``torch._VF``) is replaced, once per process, by a wrapper installed when a
``PrecisionDebugger`` of level L1/mix is created (:func:`install_api_wrappers`), as the reference
tool does: code that looks an API up when it runs (``F.relu(x)``, ``x + y``) is seen, under the
name it was called by (``Functional.relu``, ``Tensor.__add__``) and with its arguments as passed
(positional ones as ``input_args``); a function object taken before the wrappers were installed
(``activation=F.relu`` as a default argument) is not, and the APIs it calls are. Only the
outermost API is recorded: the ``torch.relu`` inside ``F.relu`` is not dumped again. Outside
``start()``/``stop()`` a wrapper only calls the original. ``torch.distributed`` functions and custom
APIs (``register_custom_api``) are replaced between ``start()`` and ``stop()`` through
:class:`~trainprobe.engine.patching.AttrPatch`, which puts back exactly the original objects.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.utils
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from trainprobe.dump.api_catalog import DISTRIBUTED_PREFIX, ApiCatalog, ApiTarget
from trainprobe.dump.collector import Collector
from trainprobe.engine.patching import AttrPatch


class ApiHub:
    """The process-wide API wrappers and the collector they report to (the debugger created last)."""

    def __init__(self) -> None:
        self.collector: Collector | None = None
        self.names: dict[tuple[int, str], str] = {}
        self.installed: set[tuple[int, str]] = set()
        self.patch = AttrPatch()

    def use(self, collector: Collector, catalog: ApiCatalog) -> None:
        """Report the catalog's APIs to ``collector`` from now on (installing missing wrappers)."""
        self.collector = collector
        self.names = {(id(t.owner), t.attr): t.name for t in catalog.targets}
        for t in catalog.targets:
            key = (id(t.owner), t.attr)
            if key not in self.installed:
                self.installed.add(key)
                self.patch.replace(t.owner, t.attr, self._wrapper(t, key))

    def uninstall(self) -> None:
        """Put every original back (for tests and embedding applications)."""
        self.patch.restore()
        self.installed.clear()
        self.names = {}
        self.collector = None

    def _wrapper(self, target: ApiTarget, key: tuple[int, str]) -> Callable[..., Any]:
        original = target.func
        hub = self

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            collector = hub.collector
            if collector is None or not collector.active:
                return original(*args, **kwargs)
            name = hub.names.get(key)
            if name is None:
                return original(*args, **kwargs)
            return collector.api_call(name, original, args, kwargs)

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        wrapper.trainprobe_api = original  # type: ignore[attr-defined]
        wrapper.__name__ = getattr(original, "__name__", target.attr)
        wrapper.__qualname__ = getattr(original, "__qualname__", target.attr)
        wrapper.__doc__ = getattr(original, "__doc__", None)
        return wrapper


HUB = ApiHub()


def install_api_wrappers(collector: Collector, catalog: ApiCatalog) -> None:
    """Wrap the catalog's APIs (once per process) and report their calls to ``collector``."""
    HUB.use(collector, catalog)


def uninstall_api_wrappers() -> None:
    """Restore every API wrapped by :func:`install_api_wrappers`."""
    HUB.uninstall()


def api_wrapper(collector: Collector, base: str, original: Callable[..., Any]) -> Callable[..., Any]:
    """A function that records ``original``'s calls as ``base`` while dumping is active."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not collector.active:
            return original(*args, **kwargs)
        return collector.api_call(base, original, args, kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    wrapper.__name__ = getattr(original, "__name__", base)
    wrapper.__doc__ = getattr(original, "__doc__", None)
    return wrapper


def patch_distributed(patch: AttrPatch, collector: Collector, apis: tuple[str, ...]) -> None:
    """Wrap ``apis`` in ``torch.distributed`` and ``distributed_c10d`` (both names of each)."""
    namespaces: tuple[ModuleType, ...] = (dist, c10d)
    for api in apis:
        original = getattr(c10d, api, None) or getattr(dist, api, None)
        if original is None:
            continue
        wrapper = api_wrapper(collector, f"{DISTRIBUTED_PREFIX}.{api}", original)
        for ns in namespaces:
            if getattr(ns, api, None) is original:
                patch.replace(ns, api, wrapper)


CLIP_GRAD_FUNCTIONS = ("clip_grad_norm_", "clip_grad_norm", "clip_grad_value_")


def watch_phases(patch: AttrPatch, collector: Collector) -> list[Any]:
    """Level mix: mark the APIs run by any ``optimizer.step()`` (torch's global step hooks; the
    handles are returned) and by ``torch.nn.utils.clip_grad_*`` (replaced through ``patch``) so
    that construct.json gives them the parent ``optimizer`` / ``clip_grad``, as the reference does."""

    def enter(phase: str) -> Callable[..., None]:
        def hook(*_: Any) -> None:
            collector.phase = phase

        return hook

    def leave(*_: Any) -> None:
        collector.phase = None

    for fname in CLIP_GRAD_FUNCTIONS:
        original = getattr(torch.nn.utils, fname, None)
        if original is not None:
            patch.replace(torch.nn.utils, fname, _in_phase(collector, "clip_grad", original))
    return [register_optimizer_step_pre_hook(enter("optimizer")), register_optimizer_step_post_hook(leave)]


def _in_phase(collector: Collector, phase: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        previous, collector.phase = collector.phase, phase
        try:
            return original(*args, **kwargs)
        finally:
            collector.phase = previous

    return wrapper
