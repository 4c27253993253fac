"""The bisect report directory: its schema, its files, and the typed `BisectResult`.

A report outlives the run that wrote it: ``--json`` prints it and minimize reads the
directory back. Its schema, file names and typed fields are therefore defined once, here,
apart from how a bisect computes them.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar, get_args

from ..kinds import BisectVerdict

REPORT_FILE = "report.json"
STATE_FILE = "state.h5"
ENTRY_STATE_FILE = "state-entering-step.h5"
SCHEMA = "sdcreplay.bisect/1"


@dataclass
class BisectResult:
    """The report: ``to_json()`` is what ``--json`` prints and report.json holds.

    The fields every report has are typed; ``findings`` holds what the verdict
    adds (the call, its elements and bits, upstream, state; docs/bisect.md),
    under the report's keys and in its order.
    """

    verdict: BisectVerdict
    step: int | None  # None: no step diverged
    suspect: str  # a device label, or "record"
    reference: str
    report: str  # the report directory
    findings: dict = field(default_factory=dict)

    _TYPED: ClassVar = ("verdict", "step", "suspect", "reference", "report")

    @classmethod
    def from_json(cls, data: dict) -> BisectResult:
        if data.get("verdict") not in get_args(BisectVerdict):
            raise ValueError(f"not a bisect verdict: {data.get('verdict')!r}")
        rest = {key: value for key, value in data.items() if key not in (*cls._TYPED, "schema")}
        return cls(
            data["verdict"], data["step"], data["suspect"], data["reference"], data["report"], rest
        )

    @property
    def exit_code(self) -> int:
        return 1 if self.verdict == "divergence" else 0

    def to_json(self) -> dict:
        typed = {name: getattr(self, name) for name in self._TYPED}
        return {"schema": SCHEMA, **typed, **self.findings}


def total(steps: dict[str, int]) -> dict[str, int]:
    """Training steps each stage executed, and in all: what a bisect costs."""
    return {**steps, "total": sum(steps.values())}


def finish(out: Path, data: dict, on_event) -> BisectResult:
    (out / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
    on_event("done", f"report written to {out}")
    return BisectResult.from_json(data)


def command_line() -> str:
    argv = sys.argv[:]
    if argv and argv[0].endswith("sdcreplay"):
        argv[0] = "sdcreplay"
    return " ".join(shlex.quote(a) for a in argv)
