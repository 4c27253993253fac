"""Inside one device's screening process: its tickets, one after another, until the first
failure or the deadline.

Each ticket's operator runs alone with the ticket's inputs, under the switches its expected
output was computed with, and every output is compared bit for bit with that expected
output (minimize's `TrialRunner`, so a planted fault fires here as it did there). The
trials of a ticket run in short chunks with the clock read between them, and a ticket is
begun only when the slowest one so far would still end before the deadline: the device
answers by the deadline with what it got through.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import h5py

from ..bisect.operator_case import OperatorCase, resolve_op
from ..capture import determinism
from ..capture.faults import parse_specs
from ..errors import SdcReplayError
from ..heartbeat import HEARTBEAT
from ..ledger.verdicts import bits_of
from ..minimize.ticket import INPUTS_FILE
from ..minimize.trials import TrialRunner
from ..replay.worker import device_task

CHUNK_SECONDS = 0.05  # the clock is read at least this often while a ticket's trials run
FIRST_TICKET_GUESS = 0.2  # seconds a ticket is assumed to take before one has been timed


def _failure(ticket: dict, trial: int, trials: int, first: dict | None) -> dict:
    first = first or {}
    indices = first.get("indices") or [None]
    return {
        "ticket": {key: ticket[key] for key in ("key", "op", "path")},
        "trial": trial,
        "trials": trials,
        "output": first.get("output"),
        "element": indices[0],
        "bits": bits_of(first.get("bits")),
        "xor": (first.get("xor") or [None])[0],
        "expected": (first.get("expected") or [None])[0],
        "actual": (first.get("actual") or [None])[0],
        "count": first.get("count"),
    }


def _run_ticket(device: str, ticket: dict, specs: list, deadline: float) -> dict:
    """One ticket's trials on ``device``: passed, failed (with where), or incomplete."""
    inputs = Path(ticket["path"]) / INPUTS_FILE
    with h5py.File(inputs, "r") as handle:
        switches = json.loads(handle.attrs["switches"])
        rank = int(handle.attrs["rank"]) if "rank" in handle.attrs else None  # a job's call
    determinism.apply(switches)
    case = OperatorCase.read(inputs)
    runner = TrialRunner(resolve_op(case.op), case.site, case.prior, device, specs, case.rng, rank)
    trials, done, chunk = ticket["trials"], 0, 1
    while done < trials:
        if time.time() >= deadline:
            return {"status": "incomplete", "trials": done, "reason": "the budget ran out"}
        started = time.perf_counter()
        measured = runner.measure(
            case.args,
            case.kwargs,
            case.expected,
            min(chunk, trials - done),
            stop_at_first_failure=True,
        )
        if measured.failures:
            trial = done + (measured.trials_to_first_failure or 1)
            return {
                "status": "failed",
                "trials": trial,
                "failure": _failure(ticket, trial, trials, measured.first_failure),
            }
        done += measured.trials
        elapsed = time.perf_counter() - started
        chunk = max(1, int(chunk * CHUNK_SECONDS / elapsed) if elapsed else chunk * 2)
    return {"status": "passed", "trials": done}


@device_task
def run_screen_task(device: str, tickets: list[dict], deadline: float, inject: list[str]) -> dict:
    """Screen ``device`` with ``tickets`` (key, op, path, trials) until its first failure or
    ``deadline`` (a ``time.time()``); each ticket's outcome, cost and the first failure."""
    began = time.time()
    specs = parse_specs(inject)
    outcomes: list[dict] = []
    slowest = FIRST_TICKET_GUESS
    for ticket in tickets:
        if time.time() + slowest > deadline:
            outcomes.append(
                {"key": ticket["key"], "status": "unrun", "reason": "the budget ran out"}
            )
            continue
        HEARTBEAT.beat(f"ticket {ticket['key']}")
        started = time.perf_counter()
        try:
            outcome = _run_ticket(device, ticket, specs, deadline)
        except SdcReplayError as exc:
            outcome = {"status": "skipped", "reason": exc.message}
        seconds = time.perf_counter() - started
        slowest = max(slowest, seconds)
        outcomes.append({"key": ticket["key"], **outcome, "seconds": round(seconds, 4)})
        if outcome["status"] == "failed":
            break
    return {"began": began, "ended": time.time(), "tickets": outcomes}
