"""A device's state, recomputed from its history in the ledger by five rules.

Nothing is stored but records, so the state always follows from the evidence, and the rule
that decided it is said with it (docs/fleet.md, "States"). Only records since the last
clearing count (``devices clear`` appends one), and a drill's (made with injected faults)
are never evidence:

- **confirmed**: a reproducer failed on it with a failure rate whose 95% interval lies
  wholly above the reference's (a minimize record: ``ci_low > reference_ci_high``), or
  findings from two independent incidents name it (different ``incident``: the bundle's
  identity, so a bundle's replay, bisect and minimize are one; a record without one counts
  by its ``job``, else its bundle or corpus);
- **suspect**: at least one finding names it;
- **drill**: only drills' findings name it (no export drains it);
- **cleared**: a person cleared it and no finding came after;
- **healthy**: no finding names it.

A finding is a record whose verdict accuses the device (``schema.FINDINGS``: a persistent
or intermittent replay, the recording suspect, a bisect divergence, a reproduced minimize,
a failed screen ticket, an alarm another device contradicted).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..ledger.schema import Record

State = Literal["healthy", "suspect", "confirmed", "drill", "cleared"]
STATES: tuple[State, ...] = ("healthy", "suspect", "confirmed", "drill", "cleared")
DRILL: State = "drill"
CLEAR_COMMAND = "clear"


def incident(record: Record) -> str:
    """What a finding's evidence comes from: findings of one incident are one piece."""
    return record.incident or record.job or record.bundle or ""


def _disjoint(record: Record) -> bool:
    return bool(
        record.command == "minimize"
        and record.finding
        and record.ci_low is not None
        and record.reference_ci_high is not None
        and record.ci_low > record.reference_ci_high
    )


@dataclass
class DeviceState:
    """A device, its state, why, and the records that decided it (oldest first)."""

    id: str
    label: str
    host: str
    model: str | None
    state: State
    reason: str
    records: list[Record]
    findings: list[Record]  # since the last clearing, drills' left out
    drills: list[Record]  # drills' findings since the last clearing

    @property
    def latest_finding(self) -> Record | None:
        return self.findings[-1] if self.findings else None

    def to_json(self) -> dict:
        last = self.records[-1]
        return {
            "id": self.id,
            "label": self.label,
            "host": self.host,
            "model": self.model,
            "state": self.state,
            "reason": self.reason,
            "evidence": len(self.records),
            "findings": len(self.findings),
            "drills": len(self.drills),
            "last_time": last.time,
            "last_verdict": f"{last.command} {last.verdict}",
        }


def judge(records: list[Record]) -> DeviceState:
    """The state of the device these records (all of one device, oldest first) name."""
    last = records[-1]
    clears = [i for i, record in enumerate(records) if record.command == CLEAR_COMMAND]
    since = records[clears[-1] + 1 :] if clears else records
    findings = [record for record in since if record.finding and not record.drill]
    drills = [record for record in since if record.finding and record.drill]
    model = next((r.identity.get("model") for r in reversed(records) if r.identity), None)
    cleared = records[clears[-1]] if clears else None
    state, reason = _rule(findings, drills, cleared, len(records))
    return DeviceState(
        last.device_id, last.label, last.host, model, state, reason, records, findings, drills
    )


def _rule(
    findings: list[Record], drills: list[Record], cleared: Record | None, total: int
) -> tuple[State, str]:
    reproducer = next((record for record in reversed(findings) if _disjoint(record)), None)
    if reproducer is not None:
        return "confirmed", (
            f"a reproducer fails here with a 95% interval above the reference's: "
            f"{reproducer.evidence}"
        )
    incidents = sorted({incident(record) for record in findings})
    if len(incidents) >= 2:
        return "confirmed", (
            f"findings from {len(incidents)} independent incidents: " + ", ".join(incidents)
        )
    if findings:
        count = f"{len(findings)} findings" if len(findings) > 1 else "1 finding"
        return "suspect", f"{count} from one incident ({incidents[0]}): {findings[-1].evidence}"
    if drills:
        count = f"{len(drills)} drill findings" if len(drills) > 1 else "1 drill finding"
        return "drill", (
            f"{count} (injected faults: {drills[-1].drill}), no evidence: {drills[-1].evidence}"
        )
    if cleared is not None:
        return "cleared", f"cleared {cleared.time}: {cleared.evidence}"
    return "healthy", f"no finding in {total} records"


def by_device(records: list[Record]) -> list[DeviceState]:
    """Every device in ``records``, in the order each was first seen."""
    grouped: dict[str, list[Record]] = {}
    for record in records:
        grouped.setdefault(record.device_id, []).append(record)
    return [judge(history) for history in grouped.values()]
