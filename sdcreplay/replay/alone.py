"""Phase 2 at scale: one rank of a job replayed without its data-parallel peers
(``sdcreplay replay JOB --rank R --alone -d D1 -d D2 [-d D3]``; ``bisect --alone`` runs its
stages the same way).

The rank runs in a process of its own that believes it is rank R of the recorded world: its
default process group is a `LonelyGroup`, in which every collective completes at once with this
rank's own data as the result of a data-parallel world of one (an all-reduce leaves its input as
it is, a broadcast keeps the local tensor, an all-gather repeats the local input, a
reduce-scatter keeps this rank's chunk of its input), except FSDP2's all-gathers into one
tensor, whose peers' chunks are their shards as the job bundle holds them (`alone_shards`).
DDP divides its gradients by the recorded world size before its all-reduce (FSDP2 averages
in its reduce-scatter), so every collective's *input* is the one the job computed, and is
checked against the record's digest up to the first reduction whose output the record does
not share; after it the replicas compute, bit for bit, the same thing as each other, not as
the job (docs/at-scale.md). Devices used: one per replica, whatever the job's size. A
model-parallel group (TP, PP) or parameters sharded over a mesh of several dimensions (HSDP)
need peers' data this process does not have, and are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.futures import Future

from ..bundle.job_bundle import JobBundle
from ..bundle.layout import ParallelLayout, require_layout
from ..capture import comparable
from ..capture.collectives import log_python_group_call
from ..capture.operators import _own_work
from ..capture.signature import SignatureLog
from ..compare.logs import RECORD, Consensus, DeviceVerdict, Divergence, compare_logs
from ..compare.messages import Messages
from ..compare.peers import first_odd_entries, record_prefix_divergence
from ..errors import DeviceError, SdcReplayError
from ..ledger.notes import note_result
from .alone_shards import PeerShards
from .job import _check_job, _rank_run, check_fault_ranks, run_rank_replay_task
from .kept_state import KeptState
from .processes import run_device_processes
from .replicas import ReplayReport, caveat_for, default_log_dir, progress_timeout
from .worker import device_task, task_function, task_reference

BACKEND = "sdcreplay_alone"
POSES_AS = {"cpu": "gloo", "cuda": "nccl"}
"""The backend a rank alone's group answers ``dist.get_backend()`` with, by its label's kind:
the workload builds its model where a rank of the job would, and its messages are named as
the record's (``gloo:all_reduce``)."""


class _Done(dist._Work):
    """A collective that completed when it was issued."""

    def __init__(self, result: Any):
        super().__init__()
        self._result = result

    def wait(self, timeout: Any = None) -> bool:
        return True

    def result(self) -> Any:
        return self._result

    def get_future(self) -> Future:
        future: Future = Future()
        future.set_result(self._result)
        return future


class LonelyGroup(dist.ProcessGroup):
    """Rank ``rank`` of a ``size``-rank world whose peers are absent: a data-parallel world of
    one (module docstring)."""

    def getBackendName(self) -> str:
        return "sdcreplay_alone"

    group = "0"  # the default group's name, as its messages give it (join_alone sets it)
    peer_shards: PeerShards | None = None  # FSDP2's peers' shards (join_alone sets them)

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """A device mesh asks; torch names a group written in Python through a backend it lacks."""
        return self.group

    def _logged(self, operator: str, args: tuple, result: Any, fill: Any = None) -> Any:
        def issue() -> Any:
            if fill is not None:
                with _own_work():  # a collective's work, never the step's operator calls
                    fill()
            return result

        work = log_python_group_call(operator, args, issue)
        return work if work is not None else _Done(result)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self._logged("allreduce_", (tensors, self.group), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self._logged("allreduce_coalesced_", (tensors, self.group), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        return self._logged("broadcast_", (tensors, self.group), tensors)

    def allgather(  # type: ignore[override]
        self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        def fill() -> None:
            for each, tensor in zip(outputs, inputs):
                for output in each:
                    output.copy_(tensor)

        return self._logged("allgather_", (outputs, inputs, self.group), outputs, fill)

    def all_gather_single(  # type: ignore[override]
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        """FSDP2's all-gather: the peers' chunks from the bundle (`alone_shards`)."""
        shards = self.peer_shards
        if shards is None:
            raise SdcReplayError(
                "rank alone: an all-gather into one tensor needs its peers' shards, and this "
                "job's layout is not FSDP2's",
                "Bisect this rank among its peers (`bisect JOB --rank R` without --alone).",
            )
        return self._logged(
            "_allgather_base_",
            (output, input, self.group),
            output,
            lambda: shards.fill(output, input),
        )

    _allgather_base = all_gather_single  # type: ignore[assignment]

    def reduce_scatter_single(  # type: ignore[override]
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        """A reduction over a world of one: this rank's own chunk of its input."""
        if opts is not None and opts.reduceOp == dist.ReduceOp.PREMUL_SUM:
            raise SdcReplayError(
                "rank alone: a reduce-scatter with a pre-multiplied sum (its factor is not "
                "readable here)",
                "Bisect this rank among its peers (`bisect JOB --rank R` without --alone).",
            )

        def fill() -> None:
            output.copy_(input.view(self.size(), -1)[self.rank()].view_as(output))

        return self._logged("_reduce_scatter_base_", (output, input, self.group), output, fill)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]

    def barrier(self, opts: Any = None) -> Any:  # type: ignore[override]
        return self._logged("barrier", ([], self.group), [])


def _lonely(store: Any, rank: int, size: int, timeout: Any) -> LonelyGroup:
    return LonelyGroup(rank, size)  # type: ignore[call-arg]


def join_alone(
    rank: int, world_size: int, device: str, peer_shards: PeerShards | None = None
) -> None:
    """Make this process rank ``rank`` of a ``world_size`` world without peers, computing on
    ``device``'s kind; ``peer_shards``: where FSDP2's all-gathers find the peers' chunks."""
    kind = device.split(":")[0]
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _lonely, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, rank=rank, world_size=world_size, store=dist.HashStore())
    world = dist.distributed_c10d._world
    group = dist.distributed_c10d._get_default_group()
    world.pg_map[group] = (POSES_AS[kind], world.pg_map[group][1])
    LonelyGroup.group = world.pg_names[group]  # as the record names it ("0")
    LonelyGroup.peer_shards = peer_shards
    if peer_shards is not None:
        peer_shards.install()


@device_task
def run_alone_task(
    device: str,
    job: str,
    rank: int,
    world_size: int,
    task: str,
    arguments: dict,
    from_state: str | None = None,
) -> dict:
    """Bisect's or replay's ``task`` on rank ``rank`` of the job, in a world without peers
    (``from_state``: a kept state's directory, whose peers' shards FSDP2 gathers)."""
    opened = JobBundle.open(job)
    sharded = require_layout(opened.layout, opened.path).sharded
    kept = KeptState.open(from_state, opened) if from_state else None
    join_alone(rank, world_size, device, PeerShards(opened, rank, kept) if sharded else None)
    try:
        return task_function(task)(device=device, **arguments)
    finally:
        dist.destroy_process_group()


def check_alone(job: JobBundle, rank: int) -> None:
    """Refuse what a rank cannot replay without its peers (module docstring)."""
    if not 0 <= rank < job.world_size:
        raise SdcReplayError(
            f"--rank {rank}: the job has ranks 0..{job.world_size - 1}",
            "Give the rank phase 1 named (`replay --same-batch`).",
        )
    layout = require_layout(job.layout, job.path)
    group = layout.model_parallel_group(rank)
    hybrid = layout.sharded and len(layout.dimensions) > 1
    if len(group) > 1 or hybrid:
        what = "its parameters are sharded over a mesh of several dimensions" if hybrid else (
            f"its model-parallel group is ranks {group}"
        )  # fmt: skip
        raise SdcReplayError(
            f"{layout.describe(rank)} cannot replay alone: {what} ({layout.shape()})",
            f"Bisect it among its peers: `sdcreplay bisect {job.path} --rank {rank} --suspect "
            "D --reference D2` (docs/distributed.md).",
        )


def alone_consensus(
    job: JobBundle,
    rank: int,
    logs: dict[str, SignatureLog],
    replayed: dict[str, Messages],
    record_step: int | None,
) -> Consensus:
    """The replicas' vote: a replica whose collective inputs leave the record in
    ``record_step`` before the first reduction it does not share is odd
    (`record_prefix_divergence`; None: the record does not vote, as from a kept state past the
    window's start, which is not the job's); so is one a strict majority of the replicas
    disagrees with (`first_odd_entries`; two that differ after that point are ``undecided``: a
    third label decides)."""
    labels = list(logs)
    peers = ParallelLayout.data_parallel_world(len(labels))
    odd, tied = first_odd_entries(peers, {i: logs[label] for i, label in enumerate(labels)})
    recorded = job.rank(rank).messages()
    voters: dict[str, DeviceVerdict] = {}
    for index, label in enumerate(labels):
        found = (
            None
            if record_step is None
            else record_prefix_divergence(recorded, replayed.get(label, {}), record_step)
        )
        where = None
        if found is not None and record_step is not None:
            message = found[1]
            name = f"collective:{message.process_group}#{message.op_id}:{message.profiling_name}"
            where = Divergence(record_step, f"{name}.input", message.input_digest or "", "another")
        elif index in odd:
            where = Divergence(odd[index].step, odd[index].entry, "the others' value", "another")
        voters[label] = DeviceVerdict(
            "persistent" if where else "match", 1, int(bool(where)), where, {}
        )
    suspects = [label for label, judged in voters.items() if judged.verdict == "persistent"]
    differ = any(log.steps != logs[labels[0]].steps for log in logs.values())
    if differ and not suspects:  # one against one: each replica is as likely
        voters = {label: DeviceVerdict("undecided", 1, 0, None, {}) for label in labels}
    for label in labels:
        voters[label].per_step = _divergent_per_step(label, logs, suspects)
    voters[RECORD] = DeviceVerdict("match", 1, 0, None, {})  # it judges, it is not judged
    verdict = "persistent" if suspects else "undecided" if differ else "correct"
    return Consensus(
        verdict,  # type: ignore[arg-type]
        suspects if suspects else labels if differ else [],
        next((voters[s].first_divergence for s in suspects), None),
        voters,
        undecided_entries=tied if differ and not suspects else 0,
    )


def _divergent_per_step(
    label: str, logs: dict[str, SignatureLog], suspects: list[str]
) -> dict[int, int]:
    """Per step, the entries where replica ``label`` differs from the first other replica not
    suspected (a suspect with no such replica: from any other; a replica trusted alone differs
    from nothing)."""
    others = [other for other in logs if other != label and other not in suspects]
    if not others and label in suspects:
        others = [other for other in logs if other != label]
    if not others:
        return dict.fromkeys(sorted(logs[label].steps), 0)
    trusted = logs[others[0]]
    common = sorted(set(trusted.steps) & set(logs[label].steps))
    return compare_logs(trusted, logs[label], common).per_step()


def replay_alone(
    bundle: str | Path,
    rank: int,
    devices: Sequence[str],
    *,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    log_dir: str | Path | None = None,
    timeout: float | None = None,
    ledger: bool = True,
    from_state: str | Path | None = None,
) -> ReplayReport:
    """Phase 2 (module docstring): rank ``rank`` replayed alone once on each of ``devices``;
    the replicas vote with each other, the record where the rank alone still computes it;
    ``from_state``: start at a kept state (`kept_state`) rather than the window's start."""
    job = JobBundle.open(bundle)
    first = _check_job(job)
    check_alone(job, rank)
    kept = KeptState.open(from_state, job) if from_state is not None else None
    check_fault_ranks(inject, job.world_size)
    labels = list(devices)
    if len(labels) < 2 or len(set(labels)) != len(labels):
        raise DeviceError(
            f"--alone needs two or three distinct device labels, got {labels}",
            "Give -d SUSPECT -d REFERENCE [-d THIRD] (a third decides a divergence the record "
            "cannot).",
        )
    log_dir = Path(log_dir) if log_dir else default_log_dir(job.path)
    part = job.rank(rank)

    def arguments(label: str) -> dict:
        directory = log_dir / label.replace(":", "-")
        directory.mkdir(parents=True, exist_ok=True)
        replay = {
            "job": job.path,
            "log_dir": directory,
            "repeats": 1,
            "inject": list(inject),
            "last_step": last_step,
            "start_state": None if kept is None else [kept.rank_state(rank), kept.step],
        }
        return {
            "job": job.path,
            "rank": rank,
            "world_size": job.world_size,
            "task": task_reference(run_rank_replay_task),
            "arguments": replay,
            "from_state": None if kept is None else kept.path,
        }

    results = run_device_processes(
        "replay-alone",
        run_alone_task,
        labels,
        arguments,
        log_dir,
        environment=comparable.pinned_environment(first.manifest.fingerprint),
        timeout=timeout or progress_timeout(part),
    )
    runs, replayed = [], {}
    for label in labels:
        run, messages = _rank_run(part, label, results[label])
        runs.append(run)
        if messages:
            replayed[label] = messages[0]
    healthy = {run.device: run.logs[0] for run in runs if run.error is None}
    window_start = part.steps[0].index
    # a kept state past the window's start is a same-batch replay's, not the job's
    record_step = window_start if kept is None or kept.step == window_start else None
    consensus = alone_consensus(job, rank, healthy, replayed, record_step) if healthy else None
    for run in runs:
        if consensus is not None and run.device in consensus.voters:
            run.judgement = consensus.voters[run.device]
    report = ReplayReport(
        str(part.path), 1, str(log_dir), runs, consensus, caveat_for(first), list(inject)
    )
    if ledger:
        note_result(report.to_json())
    return report
