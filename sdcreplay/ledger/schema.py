"""The ledger's one table, its record type, and the versioned migrations that build it.

Every verdict with evidence is a row of ``records``; nothing is ever updated or deleted (a
clearing is a record too), so a device's state is always recomputed from its history. The
layout is reached by numbered migrations, applied in order, each once, inside one
transaction, and noted in ``schema_migrations`` (docs/fleet.md, "The ledger"): a ledger
written by an older sdcreplay is brought up to date the first time a newer one opens it,
and every row it held stays. The SQL is the common subset of SQLite and PostgreSQL; the
one type they spell differently, an auto-numbered key, is filled in per backend.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field, fields

from .. import __version__

MIGRATIONS: list[tuple[int, str, list[str]]] = [
    (
        1,
        "the first layout: who, when, what command said what",
        [
            "CREATE TABLE records ("
            " id {serial},"
            " time TEXT NOT NULL,"
            " device_id TEXT NOT NULL,"
            " host TEXT NOT NULL,"
            " job TEXT,"
            " command TEXT NOT NULL,"
            " verdict TEXT NOT NULL,"
            " evidence TEXT NOT NULL,"
            " report TEXT,"
            " tool_version TEXT NOT NULL)",
        ],
    ),
    (
        2,
        "the evidence in columns (label, finding, operator, element, bits, rate and interval, "
        "rank, iteration) and an index by device",
        [
            "ALTER TABLE records ADD COLUMN label TEXT",
            "ALTER TABLE records ADD COLUMN identity TEXT NOT NULL DEFAULT '{{}}'",
            "ALTER TABLE records ADD COLUMN bundle TEXT",
            "ALTER TABLE records ADD COLUMN finding INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE records ADD COLUMN operator TEXT",
            "ALTER TABLE records ADD COLUMN element TEXT",
            "ALTER TABLE records ADD COLUMN bits TEXT",
            "ALTER TABLE records ADD COLUMN rate DOUBLE PRECISION",
            "ALTER TABLE records ADD COLUMN ci_low DOUBLE PRECISION",
            "ALTER TABLE records ADD COLUMN ci_high DOUBLE PRECISION",
            "ALTER TABLE records ADD COLUMN reference_ci_high DOUBLE PRECISION",
            "ALTER TABLE records ADD COLUMN rank INTEGER",
            "ALTER TABLE records ADD COLUMN iteration INTEGER",
            # A version-1 row said what it found only in its verdict.
            "UPDATE records SET finding = 1 WHERE verdict IN "
            "('persistent', 'intermittent', 'recording_suspect', 'divergence', 'reproduced', "
            "'failed')",
            "CREATE INDEX records_by_device ON records (device_id, id)",
        ],
    ),
    (
        3,
        "the incident a record's evidence comes from (the bundle's identity: its commands' "
        "findings count once) and the drill mark (the injected faults: never evidence)",
        [
            "ALTER TABLE records ADD COLUMN incident TEXT",
            "ALTER TABLE records ADD COLUMN drill TEXT",
            # A version-2 row said it was a drill only in its evidence.
            "UPDATE records SET drill = 'marked in the evidence' WHERE evidence LIKE '%[drill: %'",
        ],
    ),
]
LATEST = MIGRATIONS[-1][0]

FINDINGS = ("persistent", "intermittent", "recording_suspect", "divergence", "reproduced", "failed")
"""Verdicts that accuse the device they name (``finding``); any other verdict is history."""


def now() -> str:
    """UTC, ISO 8601 with microseconds: sorts as text, reads as a time."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="microseconds")


@dataclass
class Record:
    """One verdict on one device, with its evidence in one line and in columns."""

    device_id: str
    label: str
    host: str
    command: str  # replay, bisect, minimize, screen, alarm, dump, clear
    verdict: str
    evidence: str  # one line a person reads: entry or operator, element, bits, rate
    finding: bool | None = None  # does it accuse the device (default: its verdict is a FINDING)
    job: str | None = None  # the scheduler's job id of the run, else what it judged
    bundle: str | None = None  # the bundle (or corpus) the evidence is about
    report: str | None = None  # where the full evidence lies
    operator: str | None = None
    element: str | None = None
    bits: str | None = None
    rate: float | None = None
    ci_low: float | None = None  # Wilson 95% interval of the rate
    ci_high: float | None = None
    reference_ci_high: float | None = None  # the reference's upper bound, same trials
    rank: int | None = None
    iteration: int | None = None  # the training step, where there is one
    incident: str | None = None  # what the evidence comes from: ``bundle:<manifest digest>``
    drill: str | None = None  # the injected faults' specs: a drill, never evidence
    identity: dict = field(default_factory=dict)  # DeviceIdentity.to_json()
    time: str = field(default_factory=now)
    tool_version: str = __version__
    id: int | None = None  # given by the ledger

    def __post_init__(self) -> None:
        if self.finding is None:
            self.finding = self.verdict in FINDINGS

    def to_json(self) -> dict:
        return {item.name: getattr(self, item.name) for item in fields(self)}


COLUMNS = [item.name for item in fields(Record) if item.name != "id"]


def row_values(record: Record) -> list:
    """A record as the values of ``COLUMNS``, in a form both databases store."""
    values = []
    for name in COLUMNS:
        value = getattr(record, name)
        if name == "identity":
            value = json.dumps(value, sort_keys=True)
        elif name == "finding":
            value = int(bool(value))
        values.append(value)
    return values


def from_row(row: dict) -> Record:
    """A stored row (any schema version since 1: a column it lacks reads as its default)."""
    known = {name: row[name] for name in ("id", *COLUMNS) if row.get(name) is not None}
    known["finding"] = bool(known.get("finding", False))
    known["identity"] = json.loads(known.get("identity") or "{}")
    known.setdefault("label", known["device_id"].partition("@")[0])
    return Record(**known)
