"""Runs that end by design after their first step: ``print_struct`` and ``cc_log_only``.

Both end the training process cleanly: the front door stops the monitor (every file written and
closed), prints one message saying where the output is and how to train normally, and raises
``SystemExit`` from ``optimizer.step()`` with exit code 0; 1 when ``cc_log_only`` could not write
``cc_log.json`` (the message says why; the call sites were printed on the console), so a script
never takes a missing file for a finished log.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainprobe.engine.probes.base import Probe
from trainprobe.engine.probes.collectives import CollectiveProbe
from trainprobe.frontdoors.monitor_v1.struct import StructProbe


def run_end_message(extras: Sequence[Probe], probes: Sequence[Probe]) -> tuple[str, int] | None:
    """The message ending the run after this step and its exit code, or None to go on.

    Args:
        extras: the monitor's own probes (the structure probe of ``print_struct``).
        probes: the running session's probes (the collective probe of ``cc_log_only``).
    """
    for probe in extras:
        if isinstance(probe, StructProbe) and probe.done():
            return (
                f"trainprobe: print_struct is set: the model structure is in {probe.path}; the run ends here "
                '(exit code 0). Set "print_struct": false to train.',
                0,
            )
    for probe in probes:
        if isinstance(probe, CollectiveProbe) and probe.spec.cc_log_only and probe.log_error is not None:
            return (
                f"trainprobe: cc_log_only is set: the collective call sites were printed above, but "
                f"{probe.log_path} could not be written ({probe.log_error}); the run ends here (exit code 1). "
                "Fix the output folder, or copy the call sites from the console.",
                1,
            )
        if isinstance(probe, CollectiveProbe) and probe.spec.cc_log_only:
            return (
                f"trainprobe: cc_log_only is set: the collective call sites were printed (and kept in "
                f'{probe.log_path}); the run ends here (exit code 0). Set "cc_codeline" from them and '
                '"cc_log_only": false to monitor.',
                0,
            )
    return None
