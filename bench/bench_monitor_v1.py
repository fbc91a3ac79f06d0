"""Overhead of Monitor V1 (``TrainerMon``) on the small GPT of ``bench_monitor_v2.py``.

Same model, data, method and report as ``bench/bench_monitor_v2.py`` (alternating monitored and
unmonitored blocks, median of pair ratios, settled RSS growth; read its docstring): this script
reuses that harness and only swaps the monitor. Each monitored block creates a ``TrainerMon``
over a V1 config (``params_have_main_grad=False``, ``grad_acc_steps=1``) and calls
``set_monitor()`` before the block and ``stop()`` after it; the CSV output goes to a temporary
``MONITOR_OUTPUT_DIR``.

Targets: V1 wg + mv + param ≤ 1.05x; xy_distribution with all_xy ≤ 1.35x and RSS growth ≤ 10%.

Usage::

    python bench/bench_monitor_v1.py            # full run
    python bench/bench_monitor_v1.py --quick    # smoke run
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import bench_monitor_v2 as harness  # noqa: E402
from trainprobe.frontdoors.monitor_v1 import TrainerMon  # noqa: E402

OPS = ["min", "max", "norm", "mean", "nans"]
CONFIGS: tuple[harness.BenchConfig, ...] = (
    harness.BenchConfig("control", "control", None),
    harness.BenchConfig(
        "v1_wg_mv_param",
        "V1 wg+mv+param",
        {"wg_distribution": True, "mv_distribution": True, "param_distribution": True, "ops": OPS},
        ratio_target=1.05,
    ),
    harness.BenchConfig(
        "v1_all_xy",
        "V1 xy_distribution, all_xy",
        {"xy_distribution": True, "all_xy": True, "ops": OPS},
        ratio_target=1.35,
        rss_target_pct=10.0,
    ),
)


class V1Monitor:
    """Gives ``TrainerMon`` the ``start()``/``stop()`` shape the harness drives."""

    def __init__(self, spec: dict[str, Any], **_: Any) -> None:  # ``fr=`` (framework): PyTorch only
        self.out = Path(spec["output_dir"])
        self.config = spec["monitors"]
        self._mon: TrainerMon | None = None

    def start(self, model: Any = None, optimizer: Any = None, **_: Any) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        os.environ["MONITOR_OUTPUT_DIR"] = str(self.out)
        path = self.out / "monitor_config.json"
        path.write_text(json.dumps(self.config), encoding="utf-8")
        self._mon = TrainerMon(str(path), params_have_main_grad=False)
        self._mon.set_monitor(model, grad_acc_steps=1, optimizer=optimizer)

    def stop(self) -> None:
        if self._mon is not None:
            self._mon.stop()
            self._mon = None


def main(argv: list[str] | None = None) -> int:
    harness.CONFIGS = CONFIGS
    harness.CONFIG_KEYS = {c.key: c for c in CONFIGS} | {c.label: c for c in CONFIGS}
    harness.TrainerMonitorV2 = V1Monitor  # type: ignore[assignment,misc]
    return harness.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
