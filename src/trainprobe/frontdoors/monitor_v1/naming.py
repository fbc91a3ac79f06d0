"""Monitor V1 names: parameter squashing, target matching, and the module probe's naming.

Names carry the chunk prefix ``<vpp_stage>:`` (``0:layers.0.mlp``) inside trainprobe and in
TensorBoard tags and alerts, also for a single model, as the reference writes them; the CSV
``name`` column leaves it out (:func:`bare`; ``vpp_stage`` is its own column). The root module's
name is empty (``0:`` + ``.input``). Activation rows are ``<module>.input`` / ``<module>.output``,
in file ``actv`` for the tensors and in file ``actv_grad`` for their gradients (the same row
names: the file says it is a gradient); when a call has several tensors and the target does not
pick one with ``"tuple[N]:i"``, each gets its index: ``<module>.input_0``, ``<module>.input_1``.
An output that is a tuple (or list) of several entries numbers them by position, as the
reference does, even when only one holds a tensor: ``nn.MultiheadAttention``'s ``(out, None)``
gives the row ``<module>.output_0`` (and no row for the ``None``); a tensor or a one-entry tuple
gives ``<module>.output``.

With ``squash_name`` (the default) parameter and module names are shortened to their meaningful
tail (:func:`squash_name`). Where that would give two different parameters the same name, the
first in model order keeps the shortened name and the later ones their full names, as the
reference names them (:func:`first_come_names`: ``blocks.0.norm1.weight`` → ``norm1.weight``,
``blocks.1.norm1.weight`` stays); two different modules that would share a name both keep their
full names (:func:`display_names`). Either is said in one warning listing the names kept full. ``targets`` entries match the full or the shortened name, with or
without the ``<vpp_stage>:`` prefix. Activations are collected for every module with
``all_xy``, else for the modules ``targets`` names.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from trainprobe.engine.log import warn_once
from trainprobe.engine.probes.module import Picked
from trainprobe.frontdoors.monitor_v1.config import MonitorV1Config, TargetConfig, TensorSpec
from trainprobe.frontdoors.monitor_v1.shapes import ShapeBook

_LISTED = 8
"""At most this many names are listed in a warning."""

_SQUASH = tuple(
    re.compile(p)
    for p in (r"^.*\.(layers?\..*)", r"^.*\.(embeddings?\..*)", r"^.*\.(final.*)", r"^.*\.(output.*)", r"^.*\.(norm.*)")
)


def squash_name(name: str) -> str:
    """Shorten a parameter name to its meaningful tail (``module.language_model.encoder.layers.0.
    mlp.weight`` → ``layers.0.mlp.weight``); names no pattern matches are kept."""
    for pattern in _SQUASH:
        m = pattern.match(name)
        if m:
            return m.group(1)
    return name


def bare(name: str) -> str:
    """``name`` without its ``<vpp_stage>:`` prefix."""
    head, sep, tail = name.partition(":")
    return tail if sep and head.isdigit() else name


def param_targeted(config: MonitorV1Config, name: str) -> bool:
    """Whether parameter ``name`` is monitored: no targets, or a target is the parameter or
    one of the modules holding it."""
    if not config.targets:
        return True
    plain = bare(name)
    for t in config.targets:
        for candidate in (name, plain):
            if candidate == t.name or candidate.startswith(t.name + "."):
                return True
    return False


def _pick(spec: TensorSpec | None, row: str, tensors: Sequence[torch.Tensor | None]) -> Picked:
    """Rows of ``tensors`` as the reference names them: one slot is ``row``; several are
    ``row_<i>`` with ``i`` the slot's position, holes (``None``: an entry of a tuple output without
    a tensor, such as ``nn.MultiheadAttention``'s ``(out, None)``) counted but given no row (the
    reference's NaN row for them is a bug). A target's ``index`` counts the tensors only."""
    if spec is not None and spec.index is not None:
        found = [t for t in tensors if t is not None]
        return [(row, found[spec.index])] if spec.index < len(found) else []
    if len(tensors) == 1:
        return [(row, tensors[0])] if tensors[0] is not None else []
    return [(f"{row}_{i}", t) for i, t in enumerate(tensors) if t is not None]


def display_name(config: MonitorV1Config, name: str) -> str:
    """``name`` (``<vpp_stage>:<module or parameter>``) as written, squashed with ``squash_name``."""
    if not config.squash_name:
        return name
    head, sep, tail = name.partition(":")
    if sep and head.isdigit():
        return f"{head}:{squash_name(tail)}"
    return squash_name(name)


@dataclass(frozen=True, slots=True)
class DisplayNames:
    """The written names of one set of names (all parameters, or all modules, of a model).

    Attributes:
        shown: full name → the name written in rows (the squashed one, or the full one where
            squashing would have merged it with another).
        squashed: full name → what :func:`display_name` makes of it alone (``targets`` entries
            may use it even where it is not written).
        kept: the names that keep their full name because of a clash, in model order.
    """

    shown: Mapping[str, str]
    squashed: Mapping[str, str]
    kept: tuple[str, ...] = ()

    def __call__(self, name: str) -> str:
        """The written name of ``name`` (a name outside the set is returned as is)."""
        return self.shown.get(name, name)

    def forms(self, name: str) -> tuple[str, ...]:
        """The names a ``targets`` entry may use for ``name``: full, written, squashed."""
        return tuple(dict.fromkeys((name, self(name), self.squashed.get(name, name))))

    def warn_clashes(self, what: str) -> None:
        """Warn once that :attr:`kept` keep their full names (nothing when none do).

        Args:
            what: the kind of names, plural (``"parameters"``, ``"modules"``).
        """
        if not self.kept:
            return
        listed = ", ".join(self.kept[:_LISTED])
        if len(self.kept) > _LISTED:
            listed += f", ... ({len(self.kept)} in all)"
        warn_once(
            f"v1-squash-clash-{what}-{'|'.join(self.kept)}",
            f"trainprobe: squash_name would give different {what} the same name; these keep their full names: {listed}",
        )


def display_names(config: MonitorV1Config, names: Iterable[str]) -> DisplayNames:
    """The written names of ``names`` (full ``<vpp_stage>:<name>``) under ``squash_name``:
    squashed, except names that squashing would make equal (to each other, or to another name
    as written), which keep their full names, so that different objects never share a name.

    Args:
        config: gives ``squash_name``.
        names: every name of one kind (all parameters, or all modules, of the model).
    """
    full = list(dict.fromkeys(names))
    squashed = {n: display_name(config, n) for n in full}
    shown = dict(squashed)
    kept: list[str] = []
    while True:  # each round gives at least one squashed name its full name back, so it ends
        owners: dict[str, list[str]] = {}
        for n in full:
            owners.setdefault(shown[n], []).append(n)
        clashes = [n for group in owners.values() if len(group) > 1 for n in group if shown[n] != n]
        if not clashes:
            break
        for n in clashes:
            shown[n] = n
        kept += clashes
    order = {n: i for i, n in enumerate(full)}
    return DisplayNames(shown=shown, squashed=squashed, kept=tuple(sorted(kept, key=order.__getitem__)))


def first_come_names(config: MonitorV1Config, names: Iterable[str], selected: Iterable[str]) -> DisplayNames:
    """The written names of parameters ``names`` (full ``<vpp_stage>:<name>``, model order) as the
    reference names them under ``squash_name``: going through the ``selected`` ones (those
    monitored; the others are never written and get their squashed name) in order, each takes
    its squashed name unless an earlier one has it, else its full name. Where that full name is
    the squashed name an earlier parameter took (``layers.0.w`` after ``a.layers.0.w``), the
    earlier one takes its full name instead, so different parameters never share a name.

    Args:
        config: gives ``squash_name``.
        names: every parameter (all of the optimizer's, for ``targets`` matching).
        selected: the monitored ones among ``names``.
    """
    full = list(dict.fromkeys(names))
    squashed = {n: display_name(config, n) for n in full}
    shown = dict(squashed)
    owner: dict[str, str] = {}
    kept: list[str] = []
    for n in dict.fromkeys(selected):
        name = squashed[n] if squashed[n] not in owner else n
        earlier = owner.get(name)
        if earlier is not None:  # its full name is what an earlier one was squashed to
            shown[earlier] = owner[earlier] = earlier
            kept.append(earlier)
        elif name != squashed[n]:
            kept.append(n)
        owner[name] = n
        shown[n] = name
    written = [shown[n] for n in dict.fromkeys(selected)]
    if len(set(written)) != len(written):  # a chain of such clashes: every clashing name full
        return display_names(config, full)
    order = {n: i for i, n in enumerate(full)}
    return DisplayNames(shown=shown, squashed=squashed, kept=tuple(sorted(set(kept), key=order.__getitem__)))


def with_roots(names: DisplayNames, roots: Iterable[str]) -> DisplayNames:
    """``names`` where each chunk's root module (full name ``<vpp>:``, the empty module name, as
    the reference names the root) is written ``<vpp>:`` even when ``squash_name`` is set."""
    shown = dict(names.shown)
    for full in roots:
        head, sep, _ = full.partition(":")
        shown[full] = f"{head}{sep}"
    return DisplayNames(shown=shown, squashed=names.squashed, kept=names.kept)


def unmatched_targets(config: MonitorV1Config, *known: DisplayNames) -> dict[str, list[str]]:
    """The ``targets`` entries that name nothing in ``known``, each with up to three close names
    (without the ``<vpp_stage>:`` prefix).

    An entry matches a name (full, written or squashed, with or without the ``<vpp_stage>:``
    prefix) that it equals or that starts with it followed by ``"."`` (a module holding it).
    """
    candidates: set[str] = set()
    for names in known:
        for name in names.shown:
            for form in names.forms(name):
                candidates.update((form, bare(form)))
    plain = sorted(c for c in candidates if bare(c) == c)
    out: dict[str, list[str]] = {}
    for t in config.targets:
        if not any(c == t.name or c.startswith(t.name + ".") for c in candidates):
            out[t.name] = difflib.get_close_matches(bare(t.name), plain, n=3, cutoff=0.6)
    return out


@dataclass(frozen=True, slots=True)
class V1Naming:
    """:class:`~trainprobe.engine.probes.module.ModuleNaming` of Monitor V1 (``targets``, ``all_xy``,
    ``forward_only``, ``backward_only``, per-tensor specs, ``squash_name``). Each module's row
    name and ``targets`` entry are worked out once and remembered (hooks run for every call).
    ``names`` gives the written module names (:func:`display_names` over the model's modules);
    without it each name is squashed alone."""

    config: MonitorV1Config
    names: DisplayNames | None = None
    forward_scope: str = "actv"
    backward_scope: str = "actv_grad"
    shapes: ShapeBook | None = None
    _known: dict[str, tuple[str, TargetConfig | None]] = field(default_factory=dict, compare=False, repr=False)

    def wants(self, vpp_stage: int, name: str, module: nn.Module) -> bool:
        return self.config.all_xy or self._lookup(name)[1] is not None

    def forward(self, name: str, kind: str, tensors: Sequence[torch.Tensor | None]) -> Picked:
        if self.config.backward_only:
            return []
        return self._noted(self.forward_scope, self._select(name, kind, kind, tensors))

    def backward(self, name: str, kind: str, tensors: Sequence[torch.Tensor | None]) -> Picked:
        if self.config.forward_only:
            return []
        return self._noted(self.backward_scope, self._select(name, kind, f"{kind}_grad", tensors))

    def _noted(self, scope: str, picked: Picked) -> Picked:
        """``picked``, each row's shape and dtype noted in :attr:`shapes` (a gradient has its
        tensor's shape and dtype, so the forward tensor describes it)."""
        if self.shapes is not None:
            for row, t in picked:
                self.shapes.note(scope, row, t)
        return picked

    def _lookup(self, name: str) -> tuple[str, TargetConfig | None]:
        """``(row name of the module, its targets entry or None)``."""
        try:
            return self._known[name]
        except KeyError:
            if self.names is not None:
                shown, forms = self.names(name), self.names.forms(name)
            else:
                shown = display_name(self.config, name)
                forms = (name, shown)
            target = next((t for t in map(self.config.target, forms) if t is not None), None)
            found = self._known[name] = (shown, target)
            return found

    def _select(self, name: str, kind: str, target_kind: str, tensors: Sequence[torch.Tensor | None]) -> Picked:
        """Rows ``<module>.<kind>`` of ``tensors``, as the target's ``target_kind`` entry says."""
        shown, target = self._lookup(name)
        row = f"{shown}.{kind}"
        if target is None:
            return _pick(None, row, tensors)
        if not target.wants(target_kind):
            return []
        return _pick(target.specs.get(target_kind), row, tensors)
