"""The bisect report directory: its schema, its files, and the typed `BisectResult`.

A report outlives the run that wrote it: ``--json`` prints it and minimize reads the
directory back. Its schema, file names and typed fields are therefore defined once, here,
apart from how a bisect computes them. A report is written whole or not at all
(`ReportDirectory`): a run that fails leaves the report already there as it was.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, get_args

from .. import leftovers
from ..errors import SdcReplayError
from ..kinds import BisectVerdict
from ..storage.rundir import make_run_dir, replacing_refused, set_aside

REPORT_FILE = "report.json"
STATE_FILE = "state.h5"
ENTRY_STATE_FILE = "state-entering-step.h5"
SCHEMA = "sdcreplay.bisect/1"
STAGING_SUFFIX = ".partial"
WORK_DIR = "work"
TICKET_FILE = "ticket.json"  # what makes a directory inside a report minimize's ticket


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


@dataclass(frozen=True)
class ReportDirectory:
    """A report being written: everything goes to ``staging`` (``REPORT.<time>-<pid>-<random>
    .partial``, this run's own, the device processes' work directory included) and `finish`
    renames it to ``final`` once the report is complete. A report already at ``final`` (and
    the tickets minimize wrote into it) is replaced only when asked (``overwrite``), and then
    moved aside, never deleted. A failed run leaves ``final`` untouched (its ``operator.h5``
    and ``report.json`` still agree) and no ``staging`` (`discard`: its error says what the
    devices said); an interrupted one leaves ``staging``, its logs in ``work/``."""

    final: Path
    staging: Path
    overwrite: bool = False

    @classmethod
    def begin(cls, out: Path, overwrite: bool = False) -> ReportDirectory:
        refuse_replacing_named(out, overwrite)
        try:
            staging = make_run_dir(out.parent, out.name + ".", STAGING_SUFFIX)
            (staging / WORK_DIR).mkdir()
        except (OSError, SdcReplayError) as exc:  # under a file, in /proc, a long name, ...
            raise _uncreatable(out, exc) from exc
        leftovers.begin(
            staging,
            "an unfinished bisect report",
            f"its {WORK_DIR}/ holds the device processes' logs; delete it once read",
        )
        return cls(out, staging, overwrite)

    @property
    def work(self) -> Path:
        return self.staging / WORK_DIR

    def while_written(self, path: Path) -> Path:
        """Where to write ``path`` now: a file meant for the final directory goes to staging."""
        return Path(_relocated(str(path), str(self.final), str(self.staging)))

    def discard(self) -> None:
        """The run failed: its staging goes, unless it holds a finished report (`_taken`)."""
        if not (self.staging / REPORT_FILE).exists():
            shutil.rmtree(self.staging, ignore_errors=True)
            leftovers.end(self.staging)

    def finish(self, data: dict, on_event) -> BisectResult:
        """Write ``report.json`` (its paths naming the final directory) and put it in place,
        the report there before moved aside (``moved_aside`` in the report)."""
        data = _relocated(data, str(self.staging), str(self.final))
        final = self.final
        taken = False
        if _holds_nothing(final):
            shutil.rmtree(final)
        elif (final.exists() or final.is_symlink()) and self.overwrite and _is_report(final):
            data["moved_aside"] = str(set_aside(final))
        else:  # another run finished there while this one ran
            taken = final.exists() or final.is_symlink()
        (self.staging / REPORT_FILE).write_text(json.dumps(data, indent=2, default=str))
        if taken:
            raise self._taken()
        try:
            self.staging.rename(final)
        except OSError as exc:
            raise self._taken() from exc
        leftovers.end(self.staging)
        on_event("done", f"report written to {self.final}")
        return BisectResult.from_json(data)

    def _taken(self) -> SdcReplayError:
        return SdcReplayError(
            f"{self.final} was written by another run while this one ran; this run's report "
            f"is in {self.staging}",
            "Give each bisect its own --out.",
            python_hint="Give each bisect its own out=.",
        )


def refuse_replacing(out: Path, overwrite: bool) -> None:
    """Refuse ``out`` unless it is free, holds nothing, or is a report ``overwrite`` may
    replace; nothing else is ever replaced."""
    if not out.exists() and not out.is_symlink():
        return
    if not _is_report(out) and not _holds_nothing(out):
        raise SdcReplayError(
            f"{out} exists and is not a bisect report, so it is not replaced",
            "Name a new --out directory, or remove that one.",
            python_hint="Name a new out= directory, or remove that one.",
        )
    if _holds_nothing(out) or overwrite:
        return
    tickets = sorted(p.name for p in out.iterdir() if (p / TICKET_FILE).is_file())
    names = ", ".join(f"{name}/" for name in tickets)
    held = f", holding the minimize ticket{'s' * (len(tickets) > 1)} {names}" if tickets else ""
    raise replacing_refused(out, f"a bisect report{held}")


def _holds_nothing(path: Path) -> bool:
    """An empty directory, or one only an old run's work directory fills."""
    if not path.is_dir() or path.is_symlink():
        return False
    return [p.name for p in path.iterdir()] in ([], [WORK_DIR])


def _is_report(path: Path) -> bool:
    if not path.is_dir() or path.is_symlink():
        return False
    try:
        report = json.loads((path / REPORT_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(report, dict) and report.get("schema") == SCHEMA


def _relocated(value: Any, staging: str, final: str) -> Any:
    """``value`` with every path under ``staging`` naming the same file under ``final``."""
    if isinstance(value, str) and (value == staging or value.startswith(staging + os.sep)):
        return final + value[len(staging) :]
    if isinstance(value, dict):
        return {key: _relocated(item, staging, final) for key, item in value.items()}
    if isinstance(value, list):
        return [_relocated(item, staging, final) for item in value]
    return value


def command_line() -> str:
    argv = sys.argv[:]
    if argv and argv[0].endswith("sdcreplay"):
        argv[0] = "sdcreplay"
    return " ".join(shlex.quote(a) for a in argv)


def refuse_replacing_named(out: Path, overwrite: bool) -> None:
    """`refuse_replacing`, a name the system cannot even look up (over 255 bytes) refused by
    name."""
    try:
        refuse_replacing(out, overwrite)
    except OSError as exc:
        raise _uncreatable(out, exc) from exc


def _uncreatable(out: Path, exc: OSError | SdcReplayError) -> SdcReplayError:
    reason = exc.strerror if isinstance(exc, OSError) else exc.message
    return SdcReplayError(
        f"cannot create the report directory beside {str(out)[:300]}: {reason}",
        "Give --out a directory that can be created (its parent a writable directory, "
        "each name at most 255 bytes).",
        python_hint="Give out= a directory that can be created (its parent a writable "
        "directory, each name at most 255 bytes).",
    )
