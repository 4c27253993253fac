"""Which step to bisect: the first entry where the suspect (or the recording) leaves the reference.

Operator-level capture is paid once per stage for one step only, so the step is found first
from a plain replay of the window, of a bundle or of one rank of a job (its peers on their
recorded devices), compared entry by entry against the reference.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..bundle.job_bundle import JobBundle
from ..bundle.reader import Bundle
from ..capture.signature import SignatureLog
from ..compare.logs import Divergence, compare_logs
from ..compare.messages import recorded_log
from ..errors import SdcReplayError
from ..replay.comparability import refuse_unlike_reference
from ..replay.job import replay_job
from ..replay.replicas import replay_devices
from ..replay.worker import DeviceFailure
from .report import total


def first_divergent_step(
    bundle: Bundle,
    suspect: str | None,
    reference: str,
    repeats: int,
    inject: Sequence[str],
    work: Path,
    on_event,
) -> tuple[int | None, dict]:
    """Replay the bundle; the first entry where the suspect (or the recording) leaves the reference.

    The reference is trusted by definition, so the suspect is compared with it
    directly, not through a majority vote: with the recording and one device
    there is no majority, and a recording made on the suspect would outvote
    the reference.
    """
    labels = [reference] + ([suspect] if suspect else [])
    on_event(
        "replay", f"replaying the window on {', '.join(labels)} to find the first divergent step"
    )
    report = replay_devices(  # the bisect's own record is the evidence: none of its steps'
        bundle.path, labels, repeats=repeats, inject=inject, log_dir=work / "replay", ledger=False
    )
    for run in report.devices:
        if run.error:
            raise SdcReplayError(
                f"the {run.device} replay failed: {DeviceFailure.from_json(run.error).said()}",
                run.error.get("hint") or "See the device's stderr in the work directory.",
            )
    runs = {run.device: run for run in report.devices}
    refuse_unlike_reference(
        {label: run.differences for label, run in runs.items()}, reference, suspect
    )
    trusted = runs[reference].logs[0]
    record_first = _first_divergence(trusted, [bundle.signature_log()])
    first = record_first if suspect is None else _first_divergence(trusted, runs[suspect].logs)
    return (first.step if first else None), {
        "replay": report.to_json(),
        "first_entry": first.brief() if first else None,
        "record_first_entry": record_first.brief() if record_first else None,
        "steps_run": total(
            {"replay": sum(len(log.steps) for r in report.devices for log in r.logs)}
        ),
    }


def first_divergent_job_step(
    job: JobBundle,
    rank: int,
    suspect: str | None,
    reference: str,
    inject: Sequence[str],
    work: Path,
) -> tuple[int | None, dict]:
    """As `first_divergent_step`, for one rank of a job: a replay of the job with the rank on
    the reference (and one with it on the suspect); the other ranks on their recorded devices."""
    recorded = [part.device for part in job.ranks]
    logs = {}
    for label in [reference] + ([suspect] if suspect else []):
        labels = [label if r == rank else device for r, device in enumerate(recorded)]
        report = replay_job(
            job.path, labels, inject=inject, log_dir=work / f"replay-{label}", ledger=False
        )
        run = report.ranks[rank].runs[0]
        failed = [run for _, run in report.failed]
        if failed:
            error = failed[0].error or {"message": "no result"}
            raise SdcReplayError(
                f"the job replay with rank {rank} on {label} failed: "
                f"{DeviceFailure.from_json(error).said()}",
                error.get("hint") or "See the ranks' logs in the work directory.",
            )
        logs[label] = run.logs
    trusted = logs[reference][0]
    record_first = _first_divergence(trusted, [recorded_log(job.rank(rank))])
    first = record_first if suspect is None else _first_divergence(trusted, logs[suspect])
    return (first.step if first else None), {
        "first_entry": first.brief() if first else None,
        "record_first_entry": record_first.brief() if record_first else None,
    }


def _first_divergence(trusted: SignatureLog, logs: Sequence[SignatureLog]) -> Divergence | None:
    """The earliest entry, in execution order, where any of ``logs`` differs from ``trusted``."""
    found = []
    for log in logs:
        first = compare_logs(trusted, log, sorted(set(trusted.steps) & set(log.steps))).first
        if first is not None:
            names = [name for name, _ in trusted.steps[first.step]]
            found.append(((first.step, names.index(first.name)), first))
    return min(found, key=lambda pair: pair[0])[1] if found else None
