"""``Anomaly.describe()`` prints a spike's ratio to its running median with a bounded width:
a 1e300 spike was a 300-digit number, a denormal median gave ``infx``."""

from __future__ import annotations

import pytest

from trainprobe.tools.diagnosis.answer import Anomaly


def spike(value: float, median: float) -> str:
    return Anomaly(
        "spike", 3, 0, "weight_grad", "reduced", "fc1.weight", op="norm", value=value, median=median
    ).describe()


@pytest.mark.parametrize(
    ("value", "median", "shown"),
    [
        (5.4352, 0.0896232, "60.6x its running median 0.0896232"),
        (999999.0, 1.0, "999999.0x its running median 1"),
        (1234567.0, 1.0, "1.23e+06x its running median 1"),
        (1e300, 1.0, "1e+300x its running median 1"),
        (1e300, 1e-300, "more than 1e308x its running median 1e-300"),
        (float("inf"), 2.0, "more than 1e308x its running median 2"),
    ],
)
def test_spike_ratio_has_a_bounded_width(value: float, median: float, shown: str) -> None:
    line = spike(value, median)
    assert line.endswith(f", {shown} (spike)"), line
    assert len(line) < 140, line


@pytest.mark.parametrize("median", [5e-324, 1e-310, -1e-315])
def test_a_denormal_median_gives_no_ratio(median: float) -> None:
    line = spike(1.0, median)
    assert line.endswith(f", over a denormal running median {median:.6g} (no ratio) (spike)"), line
    assert "inf" not in line


def test_the_smallest_normal_median_still_has_a_ratio() -> None:
    assert spike(1.0, 2.0**-1022).endswith(", 4.49e+307x its running median 2.22507e-308 (spike)")
    assert spike(1e-300, 2.0**-1022).endswith(", 4.49e+07x its running median 2.22507e-308 (spike)")
