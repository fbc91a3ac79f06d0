"""Level L1 (and mix): API calls.

``torch.*``, ``torch.nn.functional.*``, Tensor methods and ``torch._VF`` are seen through a
:class:`torch.overrides.TorchFunctionMode` entered by ``start()`` and exited by ``stop()``; torch
itself disables the mode while one of its calls runs, so an API called inside another API (the
``torch.relu`` inside ``F.relu``) is not dumped twice. ``torch.distributed`` functions and custom
APIs (``register_custom_api``) do not go through ``__torch_function__`` and are replaced by
wrappers through :class:`~trainprobe.patching.AttrPatch`, which puts back exactly the original objects.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode

from trainprobe.dump.api_catalog import DISTRIBUTED_PREFIX, ApiCatalog
from trainprobe.dump.collector import Collector
from trainprobe.patching import AttrPatch


class ApiMode(TorchFunctionMode):
    """Records the catalog's APIs while entered."""

    def __init__(self, collector: Collector, catalog: ApiCatalog) -> None:
        super().__init__()
        self._collector = collector
        self._names = catalog.names

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        if kwargs is None:
            kwargs = {}
        base = self._names.get(func)
        if base is None or not self._collector.active:
            return func(*args, **kwargs)
        return self._collector.api_call(base, func, args, kwargs)


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
