"""Per-group learning rates: named as Lightning's ``LearningRateMonitor`` names them (its own
naming code is the oracle), written by the metrics monitor next to the spec's ``learning-rate``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from test_metrics_helpers import read_events, scalars
from trainprobe.frontdoors.metrics import TrainingMetricsMonitor
from trainprobe.frontdoors.metrics.lr_groups import LrSource, lr_group_names


def params(n: int) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.zeros(2)) for _ in range(n)]


def groups(*names: str | None) -> list[dict[str, Any]]:
    """One parameter group per entry, with that ``name`` (None: no name key)."""
    return [{"params": params(1), **({"name": n} if n is not None else {})} for n in names]


CASES: dict[str, list[tuple[torch.optim.Optimizer, str | None]]] = {
    "one group": [(torch.optim.AdamW(params(2)), None)],
    "one named group": [(torch.optim.AdamW(groups("all")), None)],
    "two groups": [(torch.optim.AdamW(groups(None, None)), None)],
    "two groups, one named": [(torch.optim.AdamW(groups(None, "head")), None)],
    "two optimizers of one class": [(torch.optim.AdamW(groups(None, None)), None), (torch.optim.AdamW(params(1)), None)],
    "three optimizers, two classes": [
        (torch.optim.SGD(params(1), lr=0.1), None),
        (torch.optim.AdamW(params(1)), None),
        (torch.optim.SGD(groups("a", "b"), lr=0.1), None),
    ],
    "named schedulers": [
        (torch.optim.AdamW(params(1)), None),
        (torch.optim.AdamW(params(1)), "warmup"),
        (torch.optim.AdamW(groups(None, "head")), "decay"),
    ],
}


def lightning_names(case: list[tuple[torch.optim.Optimizer, str | None]]) -> list[list[str]]:
    """The names Lightning's ``LearningRateMonitor`` gives: optimizers with a scheduler config
    (and its ``name``) first, then the others."""
    callbacks = pytest.importorskip("lightning.pytorch.callbacks")
    from lightning.pytorch.utilities.types import LRSchedulerConfig

    monitor = callbacks.LearningRateMonitor()
    configs = [
        LRSchedulerConfig(torch.optim.lr_scheduler.StepLR(opt, 1), name=name)
        for opt, name in case
        if name is not None
    ]
    names, seen, seen_types = monitor._find_names_from_schedulers(configs)
    rest, _ = monitor._find_names_from_optimizers([opt for opt, name in case if name is None], seen, seen_types)
    return names + rest


@pytest.mark.parametrize("case", list(CASES))
def test_names_are_lightnings(case: str) -> None:
    optimizers = CASES[case]
    sources = [LrSource(opt, name) for opt, name in optimizers if name is not None]
    sources += [LrSource(opt) for opt, name in optimizers if name is None]
    assert lr_group_names(sources) == lightning_names(optimizers)


def test_the_names_spelled_out() -> None:
    """The rules as the documentation states them."""
    two = torch.optim.AdamW(groups(None, "head"))
    assert lr_group_names([LrSource(two), LrSource(torch.optim.AdamW(params(1)))]) == [
        ["lr-AdamW/pg1", "lr-AdamW/head"],
        ["lr-AdamW-1"],
    ]
    assert lr_group_names([LrSource(torch.optim.SGD(groups("all"), lr=1.0))]) == [["lr-SGD/all"]]


def test_repeated_group_names_are_refused() -> None:
    with pytest.raises(ValueError, match=r"lr-AdamW: parameter groups share the name 'x'"):
        lr_group_names([LrSource(torch.optim.AdamW(groups("x", "x")))])


def test_monitor_writes_every_groups_lr_next_to_learning_rate(tmp_path: Path) -> None:
    """Two groups (the second named) with their own learning rates, changed by a scheduler:
    ``learning-rate`` stays the first group's (the spec's tag), ``lr-SGD/pg1`` and
    ``lr-SGD/head`` are each group's, before the scheduler steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5, "name": "head"}], lr=0.1
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    config = {"tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    with TrainingMetricsMonitor(config, model=model, optimizer=optimizer) as monitor:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            monitor.step()
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    for step in (1, 2, 3):
        assert s["learning-rate"][step] == pytest.approx(0.1 * 0.5 ** (step - 1))
        assert s["lr-SGD/pg1"][step] == pytest.approx(0.1 * 0.5 ** (step - 1))
        assert s["lr-SGD/head"][step] == pytest.approx(0.5 * 0.5 ** (step - 1))
    assert "lr-SGD/pg1-vs-samples" not in s


def test_repeated_group_names_turn_only_the_group_tags_off(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Groups that cannot be told apart: one error line, no ``lr-...`` tag, the rest written."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters(), "name": "x"}, {"params": model[1].parameters(), "name": "x"}], lr=0.1
    )
    config = {"tensorboard": {"tensorboard_dir": str(tmp_path / "tb")}}
    with caplog.at_level("ERROR", logger="trainprobe"), TrainingMetricsMonitor(config, model, optimizer) as monitor:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    s = scalars(read_events(tmp_path / "tb" / "rank_0"))
    assert set(s["learning-rate"]) == {1, 2}
    assert not [t for t in s if t.startswith("lr-")]
    errors = [r for r in caplog.records if "learning rates of the parameter groups" in r.getMessage()]
    assert len(errors) == 1 and "share the name 'x'" in str(errors[0].exc_info[1])
