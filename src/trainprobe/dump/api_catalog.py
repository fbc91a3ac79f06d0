"""Which APIs level L1 dumps and under which name prefix: ``support_wrap_ops.yaml``.

The YAML file shipped next to this module lists API names per namespace (``functional``,
``tensor``, ``torch``, ``_VF``, ``distributed``); users may edit it or pass their own file. Each
listed function object maps to its dump prefix (:data:`PREFIXES`): ``F.relu`` → ``Functional.relu``.
``torch.lstm`` and ``torch._VF.lstm`` are one object; a name listed under ``_VF`` wins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainprobe.errors import ConfigError
from trainprobe.log import warn_once

DEFAULT_YAML = Path(__file__).with_name("support_wrap_ops.yaml")

# yaml key -> (namespace object, dump prefix); order = priority (later wins for shared objects)
PREFIXES: dict[str, tuple[Any, str]] = {
    "torch": (torch, "Torch"),
    "tensor": (torch.Tensor, "Tensor"),
    "functional": (F, "Functional"),
    "_VF": (torch._VF, "VF"),
}
DISTRIBUTED_PREFIX = "Distributed"


def read_api_yaml(path: str | Path) -> dict[str, list[str]]:
    """``{namespace: [api, ...]}`` from a support_wrap_ops-style YAML file.

    Uses PyYAML when installed; otherwise a reader for the file's plain ``key:`` / ``- item`` form.

    Raises:
        ConfigError: the file is missing or not of that shape.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"API list {str(file)!r} cannot be read: {exc}") from None
    try:
        import yaml  # type: ignore[import-untyped]

        data = yaml.safe_load(text) or {}
    except ImportError:
        data = _read_simple_yaml(text)
    except Exception as exc:  # noqa: BLE001 - any YAML error becomes a one-line message
        raise ConfigError(f"API list {str(file)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, list) or v is None for v in data.values()):
        raise ConfigError(f"API list {str(file)!r}: expected 'namespace:' keys each holding a list of API names")
    return {str(k): [str(x) for x in (v or [])] for k, v in data.items()}


def _read_simple_yaml(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line.startswith((" ", "\t", "-")) and line.endswith(":"):
            current = out.setdefault(line[:-1].strip(), [])
        elif line.strip().startswith("- ") and current is not None:
            current.append(line.strip()[2:].strip())
        else:
            raise ConfigError(f"API list: cannot read line {raw!r}")
    return out


@dataclass(slots=True)
class ApiCatalog:
    """Function object → dump name (``Functional.relu``), plus the distributed function names."""

    names: dict[Any, str] = field(default_factory=dict)
    distributed: tuple[str, ...] = ()

    @classmethod
    def load(cls, path: str | Path | None = None) -> ApiCatalog:
        """The catalog of ``path`` (default: the shipped ``support_wrap_ops.yaml``)."""
        lists = read_api_yaml(path or DEFAULT_YAML)
        unknown = set(lists) - set(PREFIXES) - {"distributed"}
        if unknown:
            raise ConfigError(
                f"API list: unknown namespace(s) {sorted(unknown)}; use {', '.join([*PREFIXES, 'distributed'])}"
            )
        catalog = cls()
        for key, (namespace, prefix) in PREFIXES.items():
            for api in lists.get(key, []):
                func = getattr(namespace, api, None)
                if func is None:
                    warn_once(
                        f"dump-missing-api-{key}-{api}", f"trainprobe dump: {key}.{api} not in this torch; skipped"
                    )
                    continue
                catalog.names[func] = f"{prefix}.{api}"
        import torch.distributed as dist

        catalog.distributed = tuple(api for api in lists.get("distributed", []) if hasattr(dist, api))
        return catalog

    def name_of(self, func: Callable[..., Any]) -> str | None:
        """The dump name of ``func``, or None when it is not dumped."""
        try:
            return self.names.get(func)
        except TypeError:  # unhashable callable
            return None
