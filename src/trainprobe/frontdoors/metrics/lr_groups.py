"""The learning rate of every parameter group, named as Lightning's ``LearningRateMonitor`` names
them (pure Python; the rules of ``lightning.pytorch.callbacks.LearningRateMonitor``, 2.x):

* an optimizer's base name is ``lr-<OptimizerClass>`` (``lr-AdamW``), or the ``name`` of its
  learning-rate scheduler where the trainer gives one (Lightning's ``lr_scheduler_configs``);
* the second, third ... optimizer of one class without a scheduler name gets ``-1``, ``-2`` ...
  appended (``lr-AdamW``, ``lr-AdamW-1``); a scheduler-named one gets the same suffix when
  optimizers of its class were counted before it (Lightning's rule, kept as it is);
* an optimizer with several parameter groups: ``<base>/<group name>`` per group, the group's
  ``name`` key or ``pg<i>`` (1-based): ``lr-AdamW/pg1``, ``lr-AdamW/head``;
* an optimizer with one group: ``<base>/<group name>`` when it has a ``name`` key, else
  ``<base>``.

Two groups of one optimizer with the same ``name`` cannot be told apart (Lightning refuses
them at train start): :func:`lr_group_names` raises ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LrSource:
    """One optimizer whose groups' learning rates are recorded, and its scheduler's ``name``
    (Lightning's ``LRSchedulerConfig.name``), if any. Sources are named in the order given:
    Lightning's is the optimizers with a scheduler first, then the others."""

    optimizer: Any
    scheduler_name: str | None = None


def lr_group_names(sources: Sequence[LrSource]) -> list[list[str]]:
    """For each source, the names of its parameter groups' learning rates (module docstring).

    Raises:
        ValueError: two groups of one optimizer share a ``name``.
    """
    counts: dict[type, int] = {}
    names: list[list[str]] = []
    for source in sources:
        cls = type(source.optimizer)
        if source.scheduler_name is None:
            counts[cls] = counts.get(cls, 0) + 1
        base = source.scheduler_name if source.scheduler_name is not None else f"lr-{cls.__name__}"
        if counts.get(cls, 0) > 1:
            base = f"{base}-{counts[cls] - 1}"
        groups = list(source.optimizer.param_groups)
        group_names = [str(group.get("name", f"pg{i}")) for i, group in enumerate(groups, start=1)]
        repeated = sorted({n for n in group_names if group_names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{base}: parameter groups share the name {', '.join(map(repr, repeated))}; "
                "give each group of one optimizer its own 'name'"
            )
        if len(groups) > 1:
            names.append([f"{base}/{n}" for n in group_names])
        elif groups:
            named = groups[0].get("name")
            names.append([f"{base}/{named}" if named else base])
        else:
            names.append([])
    return names
