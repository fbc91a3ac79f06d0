"""``trainprobe diagnose``'s anomalies as the report draws them: the Diagnosis section's first
anomaly and the next ones (spikes, NaN/inf, alerts), placed on the anomaly timeline so that the
timeline's star and the Diagnosis name the same event."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: Diagnose's kinds, as the timeline's legend names them.
KIND_WORDS = {"spike": "spike", "nonfinite": "NaN/inf", "alert": "alert"}


@dataclass(frozen=True, slots=True)
class Finding:
    """One anomaly of ``trainprobe diagnose`` (``diagnosis.json``'s ``anomalies`` entry).

    Attributes:
        kind: ``spike``, ``nonfinite`` or ``alert``.
        step, rank: where (a full tensor of a sharded run: the least rank whose piece went wrong,
            else the least rank holding it).
        group: the data type as the report names it (``weight_grad/reduced``, ``actv``).
        name: the tensor (module or parameter).
        micro_step: the micro-step, or None.
        line: diagnose's own words for it (``step 20, rank 1, ...: norm = 3.2, 50.1x its running median ...``).
    """

    kind: str
    step: int
    rank: int
    group: str
    name: str
    micro_step: int | None
    line: str


@dataclass(frozen=True, slots=True)
class Diagnosed:
    """What the Diagnosis section shows: diagnose's printed ``lines`` and its ``findings`` in
    execution order (the first is diagnose's first anomaly; none for a clean run or a run
    diagnose could not read); ``ran``: whether diagnose answered (False: ``lines`` say why not)."""

    lines: list[str] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    ran: bool = False

    @property
    def first(self) -> Finding | None:
        """Diagnose's first anomaly, or None."""
        return self.findings[0] if self.findings else None


def group_of(table: str, scope: str | None) -> str:
    """The report's data type of a diagnose row: ``table`` (V1, or a scope-less row), else
    ``table/scope`` (V2), as diagnose's own line writes it."""
    return table if scope in (table, "", None) else f"{table}/{scope}"


def findings_of(summary: Mapping[str, Any]) -> list[Finding]:
    """The ``anomalies`` of :func:`trainprobe.tools.diagnosis.answer.diagnosis_summary`'s answer as
    :class:`Finding` s, in its order (execution order)."""
    return [_finding(entry) for entry in summary.get("anomalies") or () if isinstance(entry, Mapping)]


def _finding(entry: Mapping[str, Any]) -> Finding:
    micro = entry.get("micro_step")
    return Finding(
        kind=str(entry.get("kind", "")),
        step=int(entry["step"]),
        rank=int(entry["rank"]),
        group=group_of(str(entry.get("table", "")), entry.get("scope")),
        name=str(entry.get("name", "")),
        micro_step=int(micro) if isinstance(micro, int) else None,
        line=str(entry.get("line", "")),
    )


def kinds_in_order(findings: Sequence[Finding]) -> list[str]:
    """The kinds present, in :data:`KIND_WORDS` order."""
    present = {f.kind for f in findings}
    return [k for k in KIND_WORDS if k in present] + sorted(present - set(KIND_WORDS))
