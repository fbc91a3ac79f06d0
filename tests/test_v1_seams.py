"""Monitor V1's seams: the backend comes from ``backend_for``, sinks are built with what they
need, a monitor that records nothing holds a null session, and folders are made through
``make_output_folder``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from test_v1_support import make_v1
from trainprobe.backends.torch.backend import TORCH, read_main_grad
from trainprobe.engine.errors import ConfigError


def test_an_unknown_framework_is_a_config_error(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"^framework: 'tensorflow' is not one of pytorch, mindspore"):
        make_v1(tmp_path, monkeypatch, {"wg_distribution": True}, framework="tensorflow")


def test_torch_backend_reads_groups_and_main_grad_as_v1_did():
    """Without torch.distributed a group has no ranks to read and asking this rank's place in
    one names the argument; ``main_grad`` is read only when asked for, and only where it is a
    tensor."""
    assert TORCH.group_ranks(object()) is None
    with pytest.raises(ConfigError, match=r"^set_monitor\(dp_group=...\): needs torch.distributed to be initialised"):
        TORCH.group_rank(object(), "set_monitor(dp_group=...)")
    assert TORCH.grad_reader(False) is None and TORCH.grad_reader(True) is read_main_grad
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.zeros(2)
    assert read_main_grad(p) is p.grad
    p.main_grad = torch.full((2,), 3.0)  # type: ignore[attr-defined]
    assert read_main_grad(p) is p.main_grad  # type: ignore[attr-defined]
