"""Screen devices with a corpus of real defects, within a time budget it never exceeds.

Every ticket's operator runs on every device, each device in its own process
(`replay.processes`, all at once; `screen_task` inside), stopping a device at its first
failure. A ticket whose expected output was computed on another kind or model of device is
skipped there with the reason: its kernels may give other bits, and a difference would be
no evidence (docs/trust-and-comparability.md).

The budget (docs/fleet.md, "Budget"): the command ends by ``started + budget``, where
``started`` is when the process began (the command line) or when `screen` was called.
The device processes are told to stop ``STOP_BEFORE`` seconds before that and are killed
``KILL_BEFORE`` seconds before it; what remains pays for writing the ledger (its waits are
capped by it) and printing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..capture.fault_spec import parse_specs
from ..devices import validate_label
from ..errors import DeviceError
from ..ledger.identity import DeviceIdentity, identify
from ..ledger.notes import note_result
from ..replay.processes import run_device_processes
from ..replay.worker import DeviceResult
from ..storage.rundir import make_run_dir, temporary_run_dir, writable_dir
from .corpus import CorpusError, CorpusTicket, read_corpus

SCHEMA = "sdcreplay.screen/1"
STOP_BEFORE = 4.0  # the device processes stop starting trials this long before the end
KILL_BEFORE = 3.0  # and are killed this long before it; the rest is the ledger's and output's
LEDGER_BEFORE = 1.0  # the ledger must be written by then


SCREEN_TASK = "sdcreplay.fleet.screen_task:run_screen_task"
"""Named, not imported: its trials import torch, which only the device processes need."""


def process_started() -> float:
    """When this process began, as a ``time.time()`` (Linux: ``/proc``), so a budget covers the
    interpreter's and torch's start-up too; now, where that cannot be read."""
    try:
        stat = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        age = float(Path("/proc/uptime").read_text().split()[0]) - int(stat[19]) / os.sysconf(
            "SC_CLK_TCK"
        )
    except (OSError, ValueError, IndexError):
        return time.time()
    return time.time() - age if 0 <= age < 86400 * 365 else time.time()


def comparable(ticket: CorpusTicket, identity: DeviceIdentity) -> str | None:
    """Why ``ticket`` cannot judge this device (its expected output came from another kind or
    model of device), or None."""
    reference = ticket.reference
    if reference.get("kind") != identity.kind:
        return (
            f"its expected output was computed on a {reference.get('kind')} "
            f"({reference.get('model')}), this is a {identity.kind}: other kernels"
        )
    if reference.get("model") != identity.model:
        return (
            f"its expected output was computed on {reference.get('model')}, this is "
            f"{identity.model}: another model's kernels may give other bits"
        )
    return None


@dataclass
class DeviceScreen:
    """One device's screening: passed, failed (its first failure), incomplete, skipped or error."""

    device: str
    identity: DeviceIdentity
    tickets: list[dict] = field(default_factory=list)  # each ticket's outcome, in order
    error: dict | None = None
    seconds: float | None = None  # from the process's start to its answer

    @property
    def failure(self) -> dict | None:
        return next((t["failure"] for t in self.tickets if t["status"] == "failed"), None)

    def count(self, status: str) -> int:
        return sum(ticket["status"] == status for ticket in self.tickets)

    @property
    def status(self) -> str:
        if self.failure is not None:
            return "failed"
        if self.error is not None:
            return "error"
        if self.count("incomplete") or self.count("unrun"):
            return "incomplete"
        return "passed" if self.count("passed") else "skipped"

    def to_json(self) -> dict:
        return {
            "device": self.device,
            "device_id": self.identity.id,
            "identity": self.identity.to_json(),
            "status": self.status,
            "failure": self.failure,
            "tickets_passed": self.count("passed"),
            "tickets_skipped": self.count("skipped"),
            "tickets_unrun": self.count("unrun") + self.count("incomplete"),
            "tickets": self.tickets,
            "seconds": self.seconds,
            "error": self.error,
        }


@dataclass
class ScreenReport:
    corpus: str
    budget: float
    started: float  # time.time() the budget counts from
    devices: list[DeviceScreen]
    inject: list[str]
    ended: float = 0.0
    launched: float = 0.0  # time.time() the device processes were started
    log_dir: str = ""
    logs_elsewhere: str | None = None  # why the logs are not under the corpus
    corpus_tickets: int = 0
    drill_tickets: int = 0  # tickets made with injected faults: all of them, it tests nothing
    drills: dict[str, list[str]] = field(default_factory=dict)  # drill ticket key -> its faults

    @property
    def exit_code(self) -> int:
        statuses = {device.status for device in self.devices}
        if "failed" in statuses:
            return 1
        return 0 if statuses == {"passed"} else 3

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "corpus": self.corpus,
            "tickets": self.corpus_tickets,
            "budget_s": self.budget,
            "seconds": round(self.ended - self.started, 3),
            "startup_s": round(self.launched - self.started, 3),
            "within_budget": self.ended - self.started <= self.budget,
            "devices": [device.to_json() for device in self.devices],
            "failed": [d.device for d in self.devices if d.status == "failed"],
            "inject": self.inject,
            "drill": bool(self.inject),
            "drill_tickets": self.drill_tickets,
            "drills": self.drills,
            "log_dir": self.log_dir,
            "logs_elsewhere": self.logs_elsewhere,
        }


def run_directory(corpus: Path, log_dir: str | Path | None) -> tuple[Path, str | None]:
    """This run's own directory for its device processes' files, inside ``log_dir`` (default
    ``CORPUS/.screen/``), and why it is not there: a corpus that cannot be written (a
    read-only mount) screens with its logs under the system's temporary directory."""
    parent = Path(log_dir) if log_dir else corpus / ".screen"
    if log_dir is None and not writable_dir(parent):
        return temporary_run_dir("screen"), f"{corpus} cannot be written"
    return make_run_dir(parent), None


def _ticket_task(ticket: CorpusTicket, corpus: Path, trials: int | None) -> dict:
    return {
        "key": ticket.key,
        "op": ticket.op,
        "path": str((corpus / ticket.directory).resolve()),
        "trials": trials or ticket.trials,
    }


def _screen_of(
    label: str,
    identity: DeviceIdentity,
    skipped: list[dict],
    result: DeviceResult | None,
    launched: float,
) -> DeviceScreen:
    screen = DeviceScreen(label, identity, tickets=list(skipped))
    if result is None:  # nothing to run here
        return screen
    if result.error is not None:
        screen.error = result.error.to_json()
        return screen
    value = result.value or {}
    screen.tickets += value.get("tickets", [])
    screen.seconds = round(value.get("ended", launched) - launched, 3)
    return screen


def screen(
    corpus: str | Path,
    devices: Sequence[str],
    *,
    budget: float = 60.0,
    trials: int | None = None,
    inject: Sequence[str] = (),
    log_dir: str | Path | None = None,
    started: float | None = None,
    ledger: bool = True,
    on_done: Callable[[str, DeviceResult], None] | None = None,
) -> ScreenReport:
    """Screen ``devices`` with every ticket of ``corpus`` by ``started + budget``.

    ``started``: the ``time.time()`` the budget counts from (default: now). ``trials``: per
    ticket (default: each ticket's own, enough to see its measured rate fail with 99%
    probability). ``ledger``: append every passed and failed device to the ledger.
    """
    started = time.time() if started is None else started
    corpus = Path(corpus)
    entries = read_corpus(corpus)
    if not entries:
        raise CorpusError(
            f"{corpus} holds no tickets", "Add some: sdcreplay corpus add CORPUS TICKET..."
        )
    labels = [validate_label(label) for label in devices]
    if len(set(labels)) != len(labels) or not labels:
        raise DeviceError(
            f"screen needs distinct device labels, got {labels}",
            "Give each device once: -d cpu:0 -d cpu:1",
        )
    specs = [str(spec) for spec in parse_specs(inject)]
    identities = {label: identify(label) for label in labels}
    plans: dict[str, list[dict]] = {}
    skipped: dict[str, list[dict]] = {}
    for label in labels:
        plans[label], skipped[label] = [], []
        for entry in entries:
            reason = comparable(entry, identities[label])
            if reason is None:
                plans[label].append(_ticket_task(entry, corpus, trials))
            else:
                skipped[label].append({"key": entry.key, "status": "skipped", "reason": reason})
    end = started + budget
    work, elsewhere = run_directory(corpus, log_dir)
    running = [label for label in labels if plans[label]]
    launched = time.time()
    results: dict[str, DeviceResult] = {}
    if running and launched < end - STOP_BEFORE:
        results = run_device_processes(
            "screen",
            SCREEN_TASK,
            running,
            lambda label: {
                "tickets": plans[label],
                "deadline": end - STOP_BEFORE,
                "inject": list(inject),
            },
            work,
            on_done=on_done,
            timeout=budget,
            deadline=end - KILL_BEFORE,
        )
    elif running:  # the budget was spent before a process could start
        for label in running:
            skipped[label] += [
                {"key": t["key"], "status": "unrun", "reason": "the budget ran out"}
                for t in plans[label]
            ]
    report = ScreenReport(
        str(corpus),
        budget,
        started,
        [
            _screen_of(label, identities[label], skipped[label], results.get(label), launched)
            for label in labels
        ],
        specs,
        log_dir=str(work),
        logs_elsewhere=elsewhere,
        corpus_tickets=len(entries),
        drill_tickets=sum(entry.drill for entry in entries),
        drills={entry.key: entry.drill_faults for entry in entries if entry.drill},
        launched=launched,
    )
    report.ended = time.time()
    if ledger:
        note_result(report.to_json(), wait=max(0.1, end - LEDGER_BEFORE - time.time()))
    report.ended = time.time()
    return report
