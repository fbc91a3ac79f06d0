"""Asking for MindSpore: import isolation, one clear error without a usable MindSpore, and
ConfigError for bad start() arguments. The first two run everywhere."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from trainprobe import ConfigError, TrainerMonitorV2

ROOT = Path(__file__).resolve().parents[1]


def test_import_trainprobe_does_not_import_mindspore():
    code = "import sys, trainprobe; print(sorted(m for m in sys.modules if 'mindspore' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"


def mindspore_usable() -> bool:
    try:
        import trainprobe.mindspore  # noqa: F401 - raises ImportError without a usable MindSpore
    except ImportError:
        return False
    return True


@pytest.mark.parametrize(("fr", "where"), [("mindspore", "fr"), (None, "framework")])
def test_asking_for_mindspore_works_or_gives_one_clear_error(tmp_path, fr, where):
    config = {"output_dir": str(tmp_path), "framework": "ms", "monitors": {"weight_grad": {"enabled": True}}}
    if mindspore_usable():
        assert TrainerMonitorV2(config, fr=fr).config.framework == "mindspore"
        return
    with pytest.raises(ConfigError, match=rf"^{where}: 'mindspore' cannot be used: .*pip install") as info:
        TrainerMonitorV2(config, fr=fr)
    if importlib.util.find_spec("mindspore") is None:
        assert 'pip install "trainprobe[mindspore]"' in str(info.value)
    else:
        assert 'pip install "numpy<2"' in str(info.value)


# -- the rest needs a usable MindSpore -----------------------------------------------------------
@pytest.fixture
def ms_monitor(tmp_path):
    support = pytest.importorskip("mindspore_support")  # skips without a usable MindSpore
    net = support.MsMLP()
    opt = support.nn.SGD(net.trainable_params(), learning_rate=0.1)

    def make(monitors: dict, **top) -> TrainerMonitorV2:
        return TrainerMonitorV2({"output_dir": str(tmp_path), "monitors": monitors, **top}, fr="ms")

    return support, net, opt, make


def test_model_must_be_a_cell(ms_monitor):
    import torch

    _, _, opt, make = ms_monitor
    mon = make({"module": {}})
    with pytest.raises(
        ConfigError, match=r"^start\(model=...\): expected a mindspore.nn.Cell or a list of them, got Linear"
    ):
        mon.start(model=torch.nn.Linear(2, 2), optimizer=opt)
    with pytest.raises(ConfigError, match=r"^start\(model=...\): expected a mindspore.nn.Cell"):
        mon.start(model=[ms_monitor[1], "not a cell"], optimizer=opt)


def test_optimizer_must_be_a_mindspore_optimizer(ms_monitor):
    import torch

    _, net, _, make = ms_monitor
    torch_opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with pytest.raises(ConfigError, match=r"^start\(optimizer=...\): expected a MindSpore optimizer .* got SGD"):
        make({"weight_grad": {"enabled": True}}).start(model=net, optimizer=torch_opt)
    with pytest.raises(ConfigError, match=r"^start\(\): monitors weight_grad, param need the optimizer"):
        make({"weight_grad": {"enabled": True}, "param": {"enabled": True}}).start(model=net)


def test_cc_without_distributed_communication_is_skipped_with_a_warning(ms_monitor, caplog):
    """cc needs mindspore.communication (tests/test_mindspore_cc.py runs it on two processes);
    without it the monitor says so once and the other monitors run."""
    _, net, opt, make = ms_monitor
    mon = make({"cc": {"enabled": True}, "param": {"enabled": True}})
    with caplog.at_level("WARNING", logger="trainprobe"):
        mon.start(model=net, optimizer=opt)
    mon.stop()
    assert "monitors.cc is enabled but mindspore's distributed communication is not initialised" in caplog.text


def test_graph_mode_is_refused_at_start(ms_monitor):
    support, net, opt, make = ms_monitor
    ms = support.ms
    mon = make({"weight_grad": {"enabled": True}})
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(ConfigError, match=r"^start\(model=...\): MindSpore runs in GRAPH_MODE.*PYNATIVE_MODE"):
            mon.start(model=net, optimizer=opt)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert support.cell_hooks_left(net, opt) == 0


def test_bad_grad_acc_steps_names_the_argument(ms_monitor):
    _, net, opt, make = ms_monitor
    with pytest.raises(ConfigError, match=r"^start\(grad_acc_steps=...\): must be an integer >= 1, got 0"):
        make({"weight_grad": {"enabled": True}}).start(model=net, optimizer=opt, grad_acc_steps=0)


def test_optimizer_monitor_skips_optimizers_without_moments(ms_monitor, caplog):
    support, net, opt, make = ms_monitor
    mon = make({"optimizer": {"enabled": True}, "param": {"enabled": True}})
    mon.start(model=net, optimizer=opt)
    grad_fn = support.ms.value_and_grad(lambda x: net(x).sum(), None, opt.parameters)
    x = support.Tensor(support.np.ones((2, 6), support.np.float32))
    with caplog.at_level("WARNING", logger="trainprobe"):
        for _ in range(2):
            opt(grad_fn(x)[1])
    mon.stop()
    out = Path(mon.config.output_dir) / "rank_0"
    assert sorted(p.name for p in out.glob("param_*.csv")) == ["param_step0-0.csv", "param_step1-1.csv"]
    assert not any(out.glob("optimizer_*.csv")) or all(p.read_text().count("\n") == 1 for p in out.glob("optimizer_*"))
