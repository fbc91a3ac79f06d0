"""seed_all and random_save. They change the process for good (that is their job), so each
scenario runs in a fresh interpreter."""

from __future__ import annotations

import csv
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainprobe.dump import seed_all
from trainprobe.engine.errors import ConfigError


def run_script(code: str, cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_seed_all_prints_the_spec_values(tmp_path: Path) -> None:
    out = run_script(
        """
        import torch
        from trainprobe.pytorch.precision_debugger import seed_all
        seed_all(seed=1234, mode=True)
        print(torch.mean(torch.randn(2, 2)), torch.mean(torch.randn(2, 2)))
        seed_all(seed=1234, mode=True, is_enhanced=True)
        print(torch.mean(torch.randn(2, 2)), torch.mean(torch.randn(2, 2)))
        seed_all(seed=7, rm_dropout=True)
        import torch.nn.functional as F
        print(F.dropout(torch.ones(4), 0.5).tolist(), torch.nn.Dropout(0.3).p, torch.nn.Dropout2d().p)
        import os
        print(os.environ["PYTHONHASHSEED"], torch.are_deterministic_algorithms_enabled())
        """,
        tmp_path,
    )
    lines = out.splitlines()
    assert lines[0] == "tensor(-0.0866) tensor(0.2038)"
    assert lines[1] == "tensor(-0.0866) tensor(-0.0866)"
    assert lines[2] == "[1.0, 1.0, 1.0, 1.0] 0.0 0.0"
    assert lines[3] == "7 True"


def test_random_save_lists_random_calls_with_their_stacks(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import torch.nn as nn
            import torch.nn.functional as F
            from trainprobe.pytorch.precision_debugger import random_save
            random_save(output_path="./output")

            class ModuleOP(nn.Module):
                def __init__(self) -> None:
                    super().__init__()
                    self.linear = nn.Linear(in_features=8, out_features=4)

                def forward(self, x):
                    return F.dropout(F.relu(self.linear(x)), 0.5)

            model = ModuleOP()
            for _ in range(3):
                model(torch.randn(10, 8)).sum().backward()
            """
        ),
        encoding="utf-8",
    )
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    files = list((tmp_path / "output").glob("random_proc*_*.csv"))
    assert len(files) == 1
    with files[0].open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    apis = [r["api_name"] for r in rows]
    assert "torch.nn.functional.dropout" in apis and "torch.randn" in apis and "torch.Tensor.uniform_" in apis
    dropout = next(r for r in rows if r["api_name"] == "torch.nn.functional.dropout")
    assert "train.py, line 14, in forward" in dropout["stack"]
    assert apis.count("torch.nn.functional.dropout") == 1  # one row per call site


def test_seed_all_rejects_bad_arguments() -> None:
    with pytest.raises(ConfigError, match=r"seed_all\(seed=...\): expected an integer"):
        seed_all(seed="1")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"seed_all\(mode=...\): expected True or False"):
        seed_all(mode=1)  # type: ignore[arg-type]


def test_the_wrappers_are_patches_that_restore_exactly(tmp_path: Path) -> None:
    """seed_all's and random_save's wrappers go through AttrPatch: restoring them leaves torch,
    NumPy and ``random`` exactly as they were (a class gets back only what it held itself)."""
    out = run_script(
        """
        import random, numpy as np, torch
        import torch.nn.functional as F
        from torch import nn
        before = (F.dropout, torch.randn, torch.rand, np.random.rand, random.random, torch.Tensor.normal_,
                  "__init__" in vars(nn.Dropout), nn.Dropout.__init__)
        from trainprobe.dump.seed import random_save, restore_patches, seed_all
        seed_all(seed=3, rm_dropout=True, is_enhanced=True)
        random_save(output_path="./output")
        assert F.dropout is not before[0] and torch.randn is not before[1] and np.random.rand is not before[3]
        restore_patches()
        after = (F.dropout, torch.randn, torch.rand, np.random.rand, random.random, torch.Tensor.normal_,
                 "__init__" in vars(nn.Dropout), nn.Dropout.__init__)
        seed_all(seed=3, rm_dropout=True)  # installs its wrappers again after a restore
        random_save(output_path="./output")
        again = F.dropout is not before[0] and torch.randn is not before[1]
        restore_patches()
        print(all(a is b for a, b in zip(before, after)) and before[6] == after[6] and again)
        """,
        tmp_path,
    )
    assert out.strip() == "True"
