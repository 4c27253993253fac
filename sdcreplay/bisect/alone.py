"""Bisect on one rank of a job without its data-parallel peers (``bisect JOB --rank R --alone
--suspect D1 --reference D2``): phase 2 at scale (docs/at-scale.md).

Each stage runs in one process per label, as a single process's bisect does, but the process
is rank R of the recorded world in a group without peers (`replay.alone.LonelyGroup`): two
devices whatever the job's size. The step is found by replaying the rank alone on both labels
(`replay.alone.replay_alone`); later stages start from the state entering it. From a state
phase 1 kept (``--from-state DIR``), the step is the kept one and every stage starts there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from ..bundle.job_bundle import JobBundle
from ..compare.logs import compare_logs
from ..errors import SdcReplayError
from ..replay.alone import check_alone, replay_alone, run_alone_task
from ..replay.kept_state import KeptState
from ..replay.processes import run_device_processes
from ..replay.worker import task_reference


def check_bisect_alone(job: JobBundle | None, rank: int | None, suspect: str | None) -> None:
    """Refuse --alone where it means nothing: a single process's bundle, no suspect."""
    if job is None or rank is None:
        raise SdcReplayError(
            "--alone is for a job bundle's rank: give --rank R",
            "Give the rank `replay --same-batch` named, e.g. --rank 2 --alone.",
        )
    if suspect is None:
        raise SdcReplayError(
            "--alone needs --suspect: a rank alone computes the record's values only up to its "
            "first reduction over peers, so the recording cannot be the suspect",
            "Give --suspect D1 --reference D2, two devices to replay the rank on.",
        )
    check_alone(job, rank)


def kept_state_to_bisect(
    job: JobBundle | None, alone: bool, from_state: str | Path, step: int | None
) -> tuple[JobBundle, KeptState, int]:
    """The kept state a rank alone starts at, and its step (``--step``, if given, must be it)."""
    if job is None or not alone:
        raise SdcReplayError(
            "--from-state is for a job's rank bisected alone",
            "Add --rank R --alone, or leave out --from-state.",
            python_hint="Pass rank=R, alone=True, or leave out from_state=.",
        )
    kept = KeptState.open(from_state, job)
    if step is not None and step != kept.step:
        raise SdcReplayError(
            f"--step {step}: the kept state {kept.path} enters step {kept.step}",
            f"Give --step {kept.step}, or leave --step out.",
            python_hint=f"Give step={kept.step}, or leave step= out.",
        )
    return job, kept, kept.step


def run_alone(
    kind: str,
    task: Callable[..., dict],
    label: str,
    arguments: dict,
    *,
    job: JobBundle,
    rank: int,
    work: Path,
    environment: dict[str, str],
    from_state: Path | None = None,
) -> dict:
    """``task`` as rank ``rank`` of the job without peers, in one process on ``label``
    (``from_state``: a kept state, whose peers' shards FSDP2 gathers)."""
    wrapped = {
        "job": job.path,
        "rank": rank,
        "world_size": job.world_size,
        "task": task_reference(task),
        "arguments": arguments,
        "from_state": from_state,
    }
    results = run_device_processes(
        kind, run_alone_task, [label], lambda _: wrapped, work, environment=environment
    )
    error = results[label].error
    if error is not None:
        raise SdcReplayError(
            f"rank {rank} alone on {label} failed: {error.said()}",
            error.hint or f"See the process's stderr in {error.log or work}.",
        )
    return results[label].value or {}


def first_divergent_alone_step(
    job: JobBundle,
    rank: int,
    suspect: str | None,
    reference: str,
    inject: Sequence[str],
    work: Path,
) -> tuple[int | None, dict]:
    """The first step where rank ``rank`` alone on ``suspect`` leaves itself on ``reference``
    (one replay of the rank alone on both)."""
    assert suspect is not None
    report = replay_alone(
        job.path, rank, [reference, suspect], inject=inject, log_dir=work / "replay-alone",
        ledger=False,
    )  # fmt: skip
    failed = report.failed
    if failed:
        error = failed[0].error or {}
        raise SdcReplayError(
            f"rank {rank} alone on {failed[0].device} failed: {error.get('message')}",
            error.get("hint") or "See the process's logs in the work directory.",
        )
    trusted, other = (run.logs[0] for run in report.devices)
    first = compare_logs(trusted, other, sorted(set(trusted.steps) & set(other.steps))).first
    return (first.step if first else None), {
        "replay": report.to_json(),
        "first_entry": first.brief() if first else None,
        "record_first_entry": None,
    }
