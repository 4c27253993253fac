"""Bisect on one rank of a job: the rank's step runs only among its peers.

Each stage of a job's bisect therefore runs the whole job: the bisected rank does bisect's
device task on the device under test while every other rank replays its own part on its
recorded device to serve the collectives. Which rank, and which bisect options a job allows,
are decided here too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..bundle.job_bundle import JobBundle, is_job_bundle
from ..bundle.reader import Bundle
from ..errors import SdcReplayError
from ..heartbeat import HEARTBEAT
from ..replay.job import require_own_gpus, this_rank
from ..replay.job_report import ranks_failure
from ..replay.launch import run_ranks
from ..replay.replicas import progress_timeout
from ..replay.session import ReplaySession
from ..replay.worker import device_task, task_function, task_reference
from .tasks import run_fetch_task


@device_task
def run_rank_bisect_task(
    device: str, job: str, rank: int, task: str, arguments: dict, serve_until: int
) -> dict:
    """One rank of a job bisect: rank ``rank`` runs bisect's ``task``; every other rank
    replays its own part up to step ``serve_until`` to serve the collectives."""
    mine = this_rank()
    if mine == rank:
        return task_function(task)(device=device, **arguments)
    session = ReplaySession(JobBundle.open(job).rank(mine), device)
    try:
        for record in session.steps_until(serve_until):
            HEARTBEAT.beat(f"serving step {record.index}")
            session.run_step(record)
    finally:
        session.close()
    return {}


def job_to_bisect(
    bundle: str | Path, rank: int | None, suspect: str | None, repeats: int
) -> JobBundle | None:
    """The job bundle whose rank ``rank`` is bisected, or None for a single-process bundle."""
    if not is_job_bundle(Path(bundle)):
        if rank is not None:
            raise SdcReplayError(
                f"--rank {rank} is for a job bundle (record --nproc); {bundle} is a single "
                "process's bundle",
                "Leave out --rank.",
                python_hint="Pass rank=None.",
            )
        return None
    job = JobBundle.open(bundle)
    if rank is None and job.world_size == 1:  # a one-process torchrun run
        rank = 0
    if rank is None or not 0 <= rank < job.world_size:
        raise SdcReplayError(
            f"{bundle} is a job of {job.world_size} ranks: say which rank to bisect",
            "Give --rank R, e.g. the origin_rank `sdcreplay replay` named.",
            python_hint="Pass rank=R, e.g. the origin_rank replay_job() reported.",
        )
    if repeats != 1:
        raise SdcReplayError(
            "--repeats is for a single process's bisect: a job's rank runs its step once among "
            "its peers",
            "Leave out --repeats (replay with --repeats shows an intermittent rank first).",
            python_hint="Pass repeats=1 (replay_job(..., repeats=N) shows an intermittent rank "
            "first).",
        )
    return job


def run_in_job(
    kind: str,
    task: Callable[..., dict],
    label: str,
    arguments: dict,
    *,
    job: JobBundle,
    rank: int | None,
    work: Path,
    environment: dict[str, str],
) -> dict:
    """``task`` on rank ``rank`` of the job, on ``label``, its peers serving the collectives
    on their recorded devices: its value, or the error that stops the bisect."""
    rank = rank or 0
    labels = [label if r == rank else part.device for r, part in enumerate(job.ranks)]
    require_own_gpus(labels)
    runs_step = task is not run_fetch_task or arguments.get("op_index") is not None
    job_arguments = {
        "job": job.path,
        "rank": rank,
        "task": task_reference(task),
        "arguments": arguments,
        "serve_until": arguments["step"] if runs_step else arguments["step"] - 1,
    }
    results = run_ranks(
        kind,
        run_rank_bisect_task,
        labels,
        lambda _: job_arguments,
        work / f"{kind}-{label.replace(':', '-')}",
        environment=environment,
        timeout=progress_timeout(job.rank(rank)),
    )
    failure = ranks_failure(f"the {kind} run of rank {rank} on {label}", results)
    if failure is not None:
        raise failure
    return results[rank].value or {}


def collectives_around(part: Bundle, step: int, issued_before: int | None) -> dict | None:
    """The rank's recorded collectives just before and just after a call of ``step`` that ran
    after ``issued_before`` of the step's messages (None: not known, or not a job's rank)."""
    if issued_before is None:
        return None
    messages = part.messages().get(step, [])

    def shown(position: int) -> dict | None:
        if not 0 <= position < len(messages):
            return None  # the call comes before the step's first collective, or after its last
        message = messages[position]
        return {
            "record_id": message.record_id,
            "profiling_name": message.profiling_name,
            "process_group": message.process_group,
            "message": message.brief(),
        }

    return {
        "issued_before": issued_before,
        "in_step": len(messages),
        "before": shown(issued_before - 1),
        "after": shown(issued_before),
    }
