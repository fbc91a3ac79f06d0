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


def warn_unseen_optimizer_step(step: int) -> None:
    """Warn once that the gradients were cleared (``zero_grad``) between two backward passes of
    ``step`` with no step of the monitored optimizer in between: another optimizer steps (one
    the monitor cannot follow: over copies of the parameters, a new mixed-precision wrapper), or
    ``zero_grad`` runs between the micro-batches of one step. Says what to do for both."""
    warn_once(
        "weight_grad-unseen-optimizer-step",
        f"trainprobe weight_grad: at step {step} the gradients were cleared (zero_grad) between two backward "
        "passes with no step of the optimizer given to the monitor in between. If another optimizer steps now, "
        f"the monitor does not see its steps (the rows that follow are filed under step {step}, without reduced "
        "rows): give it to the monitor (Monitor V2: stop(), then start(model=..., optimizer=new); Monitor V1: "
        "stop(), then set_monitor(...) of a new TrainerMon); a torch optimizer over the same parameters is "
        "followed by itself. Otherwise zero_grad() runs between the micro-batches of one step, and each "
        "optimizer step sees the gradient of its last micro-batch only",
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
