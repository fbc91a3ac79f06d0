"""Which APIs level L1 dumps and under which name: ``support_wrap_ops.yaml``.

The YAML file shipped next to this module lists API names per namespace (``functional``,
``tensor``, ``torch``, ``_VF``, ``distributed``); users may edit it or pass their own file. Each
listed attribute is replaced by a recording wrapper while dumping (:mod:`trainprobe.dump.api_hooks`)
and dumped as ``{Prefix}.{last name part}``: ``F.relu`` → ``Functional.relu``, ``x + y`` →
``Tensor.__add__``, ``torch.linalg.norm`` (listed as ``linalg.norm``) → ``Torch.norm``. These are
the reference tool's names, so dumps of one model by both tools line up in ``compare``.

Risk levels (``risk_level`` in config.json, as in the reference tool): when neither ``scope`` nor
``list`` is configured, ``FOCUS`` (the default) leaves out the APIs that only move or re-type data
(:data:`LOW_RISK_APIS`: ``view``, ``transpose``, ``to``, ...), ``CORE`` keeps only
:data:`CORE_APIS` and the distributed ones, ``ALL`` keeps everything; a left-out API's call
counter still advances.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from trainprobe.engine.errors import ConfigError

DEFAULT_YAML = Path(__file__).with_name("support_wrap_ops.yaml")

# yaml key -> (namespace whose attributes are replaced, dump prefix)
PREFIXES: dict[str, tuple[Any, str]] = {
    "torch": (torch, "Torch"),
    "tensor": (torch.Tensor, "Tensor"),
    "functional": (F, "Functional"),
    "_VF": (torch._VF, "VF"),
}
DISTRIBUTED_PREFIX = "Distributed"

CORE_APIS = frozenset(
    "matmul __matmul__ bmm addmm addmm_ addbmm addbmm_ baddbmm baddbmm_ mm mv addmv addmv_ addr addr_ "
    "conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d conv_tbc convolution "
    "_convolution chain_matmul linear bilinear batch_norm instance_norm layer_norm group_norm "
    "local_response_norm _batch_norm_impl_index batch_norm_elemt batch_norm_stats batch_norm_update_stats "
    "batch_norm_gather_stats batch_norm_gather_stats_with_counts batch_norm_backward_elemt "
    "batch_norm_backward_reduce embedding embedding_bag multi_head_attention_forward "
    "scaled_dot_product_attention _fused_adamw_ _fused_adam_".split()
)
"""APIs dumped at ``risk_level`` CORE (with every ``distributed`` API)."""

LOW_RISK_APIS = frozenset(
    "squeeze unsqueeze reshape reshape_as view view_as flatten unflatten expand expand_as repeat "
    "repeat_interleave tile transpose permute moveaxis movedim swapaxes swapdims chunk unsafe_chunk split "
    "split_with_sizes unsafe_split unsafe_split_with_sizes tensor_split hsplit vsplit dsplit unbind stack "
    "cat concat concatenate hstack vstack dstack column_stack row_stack align_as align_to atleast_1d "
    "atleast_2d atleast_3d ravel clamp unfold type_as to float double int long half bfloat16 byte char "
    "bool cfloat numpy empty empty_like zeros zeros_like ones ones_like full full_like arange linspace "
    "logspace eye identity diag diagflat diag_embed triu tril triu_indices tril_indices clone __bool__ "
    "stride".split()
)
"""APIs not dumped at ``risk_level`` FOCUS (the default) unless ``scope``/``list`` select APIs."""


def api_risk(api: str, distributed: bool = False) -> str:
    """``CORE``, ``LOW`` or ``FOCUS`` for the API named ``api`` (the part after the prefix)."""
    if distributed or api in CORE_APIS:
        return "CORE"
    return "LOW" if api in LOW_RISK_APIS else "FOCUS"


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


@dataclass(frozen=True, slots=True)
class ApiTarget:
    """One attribute replaced while dumping: ``owner.attr`` (the original ``func``), dumped as ``name``."""

    owner: Any
    attr: str
    func: Any
    name: str


@dataclass(slots=True)
class ApiCatalog:
    """The attributes replaced at L1/mix (:class:`ApiTarget`) plus the distributed function names."""

    targets: list[ApiTarget] = field(default_factory=list)
    distributed: tuple[str, ...] = ()

    @property
    def names(self) -> dict[Any, str]:
        """Original function object → dump name."""
        return {t.func: t.name for t in self.targets}

    @classmethod
    def load(cls, path: str | Path | None = None) -> ApiCatalog:
        """The catalog of ``path`` (default: the shipped ``support_wrap_ops.yaml``); names missing
        from the installed torch, and attributes that are not callables, are skipped."""
        lists = read_api_yaml(path or DEFAULT_YAML)
        unknown = set(lists) - set(PREFIXES) - {"distributed"}
        if unknown:
            raise ConfigError(
                f"API list: unknown namespace(s) {sorted(unknown)}; use {', '.join([*PREFIXES, 'distributed'])}"
            )
        catalog = cls()
        for key, (namespace, prefix) in PREFIXES.items():
            seen: set[str] = set()
            for api in lists.get(key, []):
                if api in seen:
                    continue
                seen.add(api)
                target = _target(namespace, api, prefix)
                if target is not None:
                    catalog.targets.append(target)
        import torch.distributed as dist

        catalog.distributed = tuple(api for api in lists.get("distributed", []) if hasattr(dist, api))
        return catalog

    def name_of(self, func: Any) -> str | None:
        """The dump name of ``func`` (an original or its installed wrapper), or None when it is
        not dumped; one function listed in two namespaces gets the later one's name
        (``torch._VF.lstm`` is ``torch.lstm``: ``VF.lstm``)."""
        func = getattr(func, "trainprobe_api", func)
        for t in reversed(self.targets):
            if t.func is func:
                return t.name
        return None


def _target(namespace: Any, api: str, prefix: str) -> ApiTarget | None:
    owner = namespace
    *path, attr = api.split(".")
    for part in path:
        owner = getattr(owner, part, None)
        if owner is None:
            return None
    func = getattr(owner, attr, None)
    func = getattr(func, "trainprobe_api", func)  # the original behind an installed wrapper
    if func is None or not callable(func) or isinstance(func, type):
        return None
    return ApiTarget(owner, attr, func, f"{prefix}.{attr}")
