"""print_struct's entries: the reference's layout for tuples, keyword arguments, frozen modules."""

from __future__ import annotations

import torch
from torch import nn

from trainprobe.frontdoors.monitor_v1.struct import describe_call

F32 = "dtype=torch.float32"


def test_tuple_output_with_a_none_and_a_keyword_argument():
    x = torch.randn(2, 3, requires_grad=True)
    mask = torch.ones(2, 3)
    out = (x * 2, None)
    entry = describe_call((x, 4), {"mask": mask}, out)
    assert entry == {
        "input": {"config": "list[2]", "0": f"size=(2, 3), {F32}", "1": f"size=(2, 3), {F32}"},
        "output": {"config": "tuple[2]", "0": f"size=(2, 3), {F32}", "1": "<class 'NoneType'>"},
        "input_grad": {"config": "tuple[2]", "0": f"size=(2, 3), {F32}", "1": "<class 'NoneType'>"},
        "output_grad": {"config": "tuple[2]", "0": f"size=(2, 3), {F32}", "1": "<class 'NoneType'>"},
    }


def test_a_frozen_module_has_no_gradient_entries_and_a_dict_output_is_its_type():
    frozen = nn.Linear(3, 3).requires_grad_(False)
    x = torch.randn(2, 3)
    assert describe_call((x,), {}, frozen(x)) == {
        "input": {"config": "list[1]", "0": f"size=(2, 3), {F32}"},
        "output": {"config": "tensor", "tensor": f"size=(2, 3), {F32}"},
    }
    assert describe_call((x,), {}, {"y": x})["output"] == {"config": "<class 'dict'>"}
