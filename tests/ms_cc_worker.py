"""One rank of the two-process MindSpore ``cc`` test (started by ``msrun`` from
``tests/test_mindspore_cc.py``): a data-parallel MLP whose gradients are averaged with the
``ops.AllReduce`` primitive, plus ``mint.distributed`` calls
(a synchronous and an asynchronous ``all_reduce``, an ``all_gather``), monitored first by Monitor
V2 (``cc`` with ``cc_pre_hook`` and ``weight_grad``), then by V2 with ``cc_log_only``, then by
Monitor V1 (``cc_distribution`` restricted by ``cc_codeline`` to the synchronous ``all_reduce``).

Usage: ``msrun --worker_num=2 --local_worker_num=2 ... ms_cc_worker.py <output folder>``
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import mindspore as ms
import mindspore.mint.distributed as dist
import numpy as np
from mindspore import Tensor, nn, ops
from mindspore.communication import get_rank, init

ms.set_device("CPU")
ms.set_context(mode=ms.PYNATIVE_MODE)
init()
RANK = get_rank()

from trainprobe import TrainerMonitorV2  # noqa: E402
from trainprobe.mindspore import TrainerMon  # noqa: E402


class Net(nn.Cell):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Dense(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Dense(8, 2)

    def construct(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


def train(net: Net, opt: nn.Optimizer, steps: int) -> None:
    allreduce = ops.AllReduce()
    grad_fn = ms.value_and_grad(lambda x: (net(x) ** 2).mean(), None, opt.parameters)
    rng = np.random.default_rng(RANK)
    for step in range(steps):
        _, grads = grad_fn(Tensor(rng.standard_normal((3, 4)).astype(np.float32)))
        grads = tuple(allreduce(g) / 2 for g in grads)  # REDUCE
        summed = Tensor(np.array([1.0 + RANK, 2.0], np.float32))
        dist.all_reduce(summed)  # SYNC: [3, 4] on both ranks
        late = Tensor(np.array([10.0 * (RANK + 1)], np.float32))
        handle = dist.all_reduce(late, async_op=True)  # ASYNC: [30]
        if step % 2 == 0:
            handle.wait()  # odd steps never wait: the monitor settles the call at the end of the step
        gathered = [Tensor(np.zeros(2, np.float32)) for _ in range(2)]
        dist.all_gather(gathered, Tensor(np.full(2, float(RANK), np.float32)))  # GATHER
        opt(grads)


def main(out: Path) -> None:
    ms.set_seed(0)
    net = Net()
    opt = nn.SGD(net.trainable_params(), learning_rate=0.1)
    v2 = {"cc": {"enabled": True, "cc_pre_hook": True}, "weight_grad": {"enabled": True}}
    mon = TrainerMonitorV2({"output_dir": str(out / "v2"), "monitors": v2}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    train(net, opt, 2)
    mon.stop()

    log_only = {"cc": {"enabled": True, "cc_log_only": True}}
    mon = TrainerMonitorV2({"output_dir": str(out / "v2_log"), "monitors": log_only}, fr="mindspore")
    mon.start(model=net, optimizer=opt)
    train(net, opt, 1)
    mon.stop()

    sync_line = next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1) if "# SYNC" in line)
    os.environ["MONITOR_OUTPUT_DIR"] = str(out / "v1")
    config = out / f"v1_config_rank{RANK}.json"
    cc = {"enable": True, "cc_codeline": [rf"ms_cc_worker\.py\[{sync_line}\]"]}
    config.write_text(json.dumps({"cc_distribution": cc, "ops": ["min", "max", "norm"]}), encoding="utf-8")
    v1 = TrainerMon(str(config))
    v1.set_monitor(net, grad_acc_steps=1, optimizer=opt)
    train(net, opt, 2)
    v1.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
