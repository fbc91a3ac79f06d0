"""What every framework's ``weight_grad`` probe says when a step's backward passes do not match
its expected micro-batches (the probes count the passes; the expected number is only a hint)."""

from __future__ import annotations

from trainprobe.engine.log import warn_once


def warn_count_mismatch(step: int, passes: int, expected: int, outcome: str) -> None:
    """Warn once when a step ran a number of backward passes other than the expected number of
    micro-batches; ``outcome`` says what its ``unreduced`` rows hold."""
    if passes == 0 or passes == expected:
        return
    warn_once(
        "weight_grad-backward-count",
        f"trainprobe weight_grad: step {step} ran {passes} backward pass(es) before the optimizer step "
        f"but grad_acc_steps (micro-batches per optimizer step) is {expected}; {outcome}. Set "
        f"grad_acc_steps (or micro_batch_number) to the number of backward passes per optimizer step "
        "(in the config, or in start(...) / set_monitor(...))",
    )


def warn_short_step(step: int, backwards: int, micro_batches: int) -> None:
    """Warn once when a collected step ran fewer backward passes than its micro-batches (no
    ``unreduced`` row can be written for it); shared by every framework's weight_grad probe."""
    if 0 < backwards < micro_batches:
        warn_once(
            "weight_grad-micro-batches",
            f"trainprobe weight_grad: step {step} ran {backwards} backward pass(es) but the number of "
            f"micro-batches is {micro_batches}, so no unreduced row was written; set grad_acc_steps (or "
            "micro_batch_number) to the micro-batches per optimizer step, in the config or in start(...)",
        )
