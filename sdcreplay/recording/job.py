"""Recording a multi-rank job: ``sdcreplay record --nproc N``, one job bundle from N ranks.

`record_job` starts the ranks under PyTorch's elastic launcher
(`replay.launch.run_ranks`), each driving the workload under a `Recorder`
(`run_rank_record_task`), which writes that rank's part of the job bundle; a
rank that fails stops the job and is named.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.job_bundle import job_partial_path
from ..bundle.writer import UNFINISHED, claim_output
from ..devices import validate_label
from ..heartbeat import HEARTBEAT
from ..kinds import SignatureLevel
from ..leftovers import writing
from ..replay.job import _same, check_fault_ranks
from ..replay.job_report import ranks_failure
from ..replay.launch import run_ranks
from ..replay.processes import UNKNOWN_STEP_TIMEOUT
from ..replay.worker import device_task
from ..storage.rundir import make_run_dir
from .drive import RecordSummary, check_dump_on, record


@device_task
def run_rank_record_task(
    device: str,
    workload: str,
    out: str,
    steps: int,
    seed: int,
    kwargs: dict,
    checkpoint: str | None = None,
    overwrite: bool = False,
    inject: Sequence[str] = (),
    max_depth: int | None = None,
    verify: bool = True,
    ring: int | None = None,
    dump_on: Sequence[str] = (),
    signature: SignatureLevel = "layer",
) -> dict:
    """One rank of a recording: the workload under a Recorder, which writes this rank's part
    (with a ring: of each job bundle the ranks dump together)."""
    summary = record(
        workload,
        out,
        steps=steps,
        device=device,
        seed=seed,
        kwargs=kwargs,
        checkpoint=checkpoint,
        overwrite=overwrite,
        inject=inject,
        max_depth=max_depth,
        verify=verify,
        on_step=lambda index, _: HEARTBEAT.beat(f"step {index}"),
        ring=ring,
        dump_on=dump_on,
        signature=signature,
    )
    return summary.to_json()


@dataclass
class JobRecordSummary(RecordSummary):
    """What ``sdcreplay record --nproc N`` wrote: rank 0's summary, and every rank's."""

    world_size: int = 1
    ranks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**super().to_json(), "world_size": self.world_size, "ranks": self.ranks}


def rank_devices(device: str, nproc: int) -> list[str]:
    """The ranks' labels for ``record --device D --nproc N``: rank r on ``cuda:r`` (as torchrun's
    LOCAL_RANK), or every rank on the CPU."""
    kind = validate_label(device).split(":")[0]
    return [f"cuda:{rank}" for rank in range(nproc)] if kind == "cuda" else ["cpu"] * nproc


def record_job(
    workload: str,
    out: str | Path,
    *,
    nproc: int,
    steps: int = 4,
    device: str = "cpu",
    seed: int = 0,
    kwargs: dict | None = None,
    checkpoint: str | Path | None = None,
    overwrite: bool = False,
    inject: Sequence[str] = (),
    max_depth: int | None = None,
    verify: bool = True,
    timeout: float = UNKNOWN_STEP_TIMEOUT,
    ring: int | None = None,
    dump_on: Sequence[str] = (),
    signature: SignatureLevel = "layer",
) -> JobRecordSummary:
    """Record ``workload`` on ``nproc`` ranks (``sdcreplay record --nproc``): one job bundle
    (with ``ring``: one per dump, as ``record`` dumps a single process's ring).

    Built-in workloads run data-parallel (``parallel="ddp"``) unless ``kwargs``
    says otherwise. The ranks' logs go to ``OUT.logs/``; a rank that fails
    stops the job and is reported (exit 3) with its rank, exit status and
    last stderr lines.
    """
    out = Path(out)
    kwargs = dict(kwargs or {})
    if workload.startswith("builtin:"):
        kwargs.setdefault("parallel", "ddp")
    check_dump_on(ring, dump_on, inject)
    check_fault_ranks(inject, nproc)
    claim_output(out, job_partial_path(out), overwrite)
    labels = rank_devices(device, nproc)
    arguments = {
        "workload": workload,
        "out": str(out),
        "steps": steps,
        "seed": seed,
        "kwargs": kwargs,
        "checkpoint": None if checkpoint is None else str(checkpoint),
        "overwrite": overwrite,
        "inject": list(inject),
        "max_depth": max_depth,
        "verify": verify,
        "ring": ring,
        "dump_on": list(dump_on),
        "signature": signature,
    }
    logs = make_run_dir(out.with_name(out.name + ".logs"))
    with writing(job_partial_path(out), "an unfinished job bundle", UNFINISHED):
        results = run_ranks(
            "record", run_rank_record_task, labels, _same(arguments), logs, timeout=timeout
        )
    failure = ranks_failure("the recording", results)
    if failure is not None:
        raise failure
    summaries = [results[rank].value or {} for rank in range(nproc)]
    first = summaries[0]
    return JobRecordSummary(
        bundle=None if first["bundle"] is None else Path(first["bundle"]),
        workload=workload,
        kwargs=first["kwargs"],
        device=", ".join(sorted(set(labels))),
        steps=first["steps"],
        entries=sum(summary["entries"] for summary in summaries),
        size_bytes=sum(summary["size_bytes"] for summary in summaries),
        final_loss=first["final_loss"],
        verification=first["verification"],
        ring=first["ring"],
        moved_aside=first["moved_aside"],
        world_size=nproc,
        ranks=[
            {
                "rank": rank,
                "device": labels[rank],
                **{k: s[k] for k in ("steps", "entries", "final_loss")},
            }
            for rank, s in enumerate(summaries)
        ],
    )
