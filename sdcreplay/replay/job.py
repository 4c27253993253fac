"""Multi-rank jobs: replay every rank of a job bundle, replica after replica.

A job bundle (`bundle.job_bundle.JobBundle`) holds one part per rank, each with
its message-order log (`capture.message.Message`). `replay_job` replays
whole replicas of the job, each under PyTorch's elastic launcher
(`launch.run_ranks`): each rank is a `ReplaySession` on its part (the recorded
message order is enforced there; a different collective or order is a
`MessageOrderError`, a structural divergence), and every rank's signatures and
messages are compared with the record and voted on per rank, as
single-process replay does (`job_report`). Device labels map to replicas and
ranks in consecutive groups of ``world_size`` labels (docs/distributed.md).
Under ``torchrun``, ``python -m sdcreplay.replay.job JOB LOGS`` (the docs' older
name ``sdcreplay.distributed`` runs it too) replays one replica spread over
several nodes.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..bundle.checkpoints import verify_checkpoint
from ..bundle.job_bundle import JobBundle
from ..bundle.manifest import CheckpointState
from ..bundle.reader import Bundle
from ..capture import comparable, determinism
from ..capture.faults import distributed_rank, other_machine_kernels, parse_specs
from ..capture.signature import read_signature_log, write_signature_log
from ..compare.jobs import REPLICA_FILE, REPLICA_SCHEMA
from ..compare.messages import Messages, read_messages, with_messages, write_messages
from ..devices import torch_device, validate_label
from ..errors import BundleError, DeviceError, FaultSpecError, SdcReplayError, StructureError
from ..heartbeat import HEARTBEAT
from ..ledger.notes import note_result
from ..storage.rundir import claim
from . import rendezvous
from .job_report import JobReplayReport, _report, ranks_failure
from .launch import GROUP_TIMEOUT_FACTOR, backend_for, join_group, run_ranks
from .processes import UNKNOWN_STEP_TIMEOUT
from .replicas import (
    DeviceRun,
    default_log_dir,
    judge_comparability,
    progress_timeout,
    refuse_unmatched_specs,
)
from .session import replay_on_device, run_recorded_probe
from .worker import DeviceResult, device_task

# ---------------------------------------------------------------------------
# Inside a rank.


def this_rank() -> int:
    """This process's rank; a rank task outside a job is the tool's mistake."""
    rank = distributed_rank()
    if rank is None:
        raise SdcReplayError("a rank task ran outside a torch.distributed job")
    return rank


@device_task
def run_rank_replay_task(
    device: str,
    job: str,
    log_dir: str,
    repeats: int,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    feed_from: list[int] | None = None,
    start_state: tuple[str, int] | None = None,
) -> dict:
    """One rank of a replica: its part's kernel probe, then its part replayed ``repeats`` times;
    signature and message logs. ``feed_from[rank]``: the rank whose batches and RNG states
    this rank's steps run on (a same-batch replay), else its own; ``start_state``: see
    `replay_on_device`."""
    opened = JobBundle.open(job)
    part = opened.rank(this_rank())
    feed = None if feed_from is None else opened.rank(feed_from[this_rank()])
    with other_machine_kernels():
        probe = run_recorded_probe(part, device)
        value = _replay_part(part, device, log_dir, repeats, inject, last_step, feed, start_state)
    return {**value, "probe": probe}


def _replay_part(
    part: Bundle,
    device: str,
    log_dir: str,
    repeats: int,
    inject: Sequence[str],
    last_step: int | None,
    feed: Bundle | None = None,
    start_state: tuple[str, int] | None = None,
) -> dict:
    rank = this_rank()
    logs, message_logs, injected = [], [], []
    warnings: list[str] = []
    unmatched: list[dict] | None = None
    compiled: list[dict] = []
    for repeat in range(repeats):
        messages: Messages = {}

        def beat(index: int, repeat: int = repeat) -> None:
            HEARTBEAT.beat(f"step {index} (repeat {repeat})")

        def keep(session: Any, index: int, messages: Messages = messages) -> None:
            messages[index] = list(session.last_messages)

        log = replay_on_device(
            part,
            device,
            last_step=last_step,
            inject=inject,
            repeat=repeat,
            on_step=beat,
            after_step=keep,
            feed=feed,
            start_state=start_state,
        )
        log.meta["rank"] = rank
        stem = Path(log_dir) / f"rank{rank}.r{repeat}"
        write_signature_log(Path(f"{stem}.sig.zst"), log)
        write_messages(Path(f"{stem}.messages.json"), rank, messages)
        logs.append(f"{stem}.sig.zst")
        message_logs.append(f"{stem}.messages.json")
        warnings = log.meta.get("warnings", [])
        injected.append(log.meta.get("injected", []))
        unmatched = log.meta["unmatched"] if unmatched is None else unmatched
        compiled = compiled or log.meta["compiled"]  # later repeats reuse the first's code
    return {
        "compiled": compiled,
        "unmatched": unmatched or [],
        "logs": logs,
        "messages": message_logs,
        "warnings": warnings,
        "injected": injected,
        "fingerprint": determinism.fingerprint(torch_device(device)),
    }


# ---------------------------------------------------------------------------
# Replay.


def check_fault_ranks(inject: Sequence[str], world_size: int) -> None:
    """Refuse a fault spec (``--inject`` or SDCREPLAY_INJECT) for a rank the job does not have."""
    for spec in parse_specs(inject):
        if spec.rank is not None and spec.rank >= world_size:
            raise FaultSpecError(
                f"fault spec {str(spec)!r} names rank {spec.rank}, but the job has ranks "
                f"0..{world_size - 1}",
                "Give rank= one of the job's ranks (`sdcreplay info JOB` lists them).",
            )


def require_own_gpus(labels: list[str]) -> None:
    """NCCL refuses two ranks of a job on one GPU; say so before starting them."""
    gpus = [label for label in labels if label.startswith("cuda")]
    if len(set(gpus)) != len(gpus):
        raise DeviceError(
            f"two ranks of one job would share a GPU: {labels}",
            "Give each rank of a replica its own cuda:N (NCCL needs one GPU per rank).",
        )


def replica_devices(job: JobBundle, devices: Sequence[str] | None) -> list[list[str]]:
    """The labels of each replica, rank by rank: consecutive groups of ``world_size`` labels
    (``--device`` order), or one replica on the recorded devices."""
    size = job.world_size
    if not devices:
        return [[part.device for part in job.ranks]]
    labels = [validate_label(label) for label in devices]
    if len(labels) % size:
        raise DeviceError(
            f"{len(labels)} device labels for a job of {size} ranks",
            f"Give {size} labels per replica, rank 0 first (e.g. "
            f"{' '.join(f'--device cpu:{r}' for r in range(size))}), or none to replay on the "
            "recorded devices.",
            python_hint=f"Give {size} labels per replica, rank 0 first (e.g. "
            f"{[f'cpu:{r}' for r in range(size)]}), or devices=None to replay on the recorded "
            "devices.",
        )
    groups = [labels[start : start + size] for start in range(0, len(labels), size)]
    link = rendezvous.current()
    per_host = link.nodes.nproc_per_node if link is not None else size  # cuda:0 on each node
    for group in groups:
        for start in range(0, size, per_host):
            require_own_gpus(group[start : start + per_host])
    for rank in range(size):
        column = [group[rank] for group in groups]
        if len(set(column)) != len(column):
            raise DeviceError(
                f"rank {rank} would replay on {column[0]} in two replicas",
                "Give each replica's rank its own label: cpu:0, cpu:1, ...",
            )
    return groups


def _check_job(job: JobBundle) -> Bundle:
    """What would fail on every rank is refused once, before any process starts; rank 0's
    part (it holds what every part shares: switches, fingerprint, state reference)."""
    first = job.rank(0)
    if not first.steps:
        raise BundleError(
            f"{job.path} holds no steps (the recording ended before its first step finished)",
            "There is nothing to replay: record again, and let at least one step complete.",
        )
    job.require_trusted()
    comparable.check_environment(first.manifest.determinism.to_json())
    if isinstance(first.manifest.state, CheckpointState):
        verify_checkpoint(first.manifest.state)
    return first


def replay_job(
    bundle: str | Path,
    devices: Sequence[str] | None = None,
    *,
    repeats: int = 1,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    log_dir: str | Path | None = None,
    timeout: float | None = None,
    on_done: Callable[[int, list[str]], None] | None = None,
    ledger: bool = True,
) -> JobReplayReport:
    """Replay every rank of a job bundle, one replica after another, and vote per rank.

    ``devices``: see `replica_devices`. ``on_done(replica, labels)`` as each
    replica ends. ``timeout``: seconds the job may go without progress
    (default: from the recorded step times). ``ledger``: append each judged device's verdict
    to the device ledger (docs/fleet.md).
    """
    job = JobBundle.open(bundle)
    first = _check_job(job)
    check_fault_ranks(inject, job.world_size)
    replicas = replica_devices(job, devices)
    log_dir = claim(log_dir) if log_dir else default_log_dir(job.path)
    timeout = timeout or max(progress_timeout(job.rank(part.rank)) for part in job.ranks)
    runs: dict[int, list[DeviceRun]] = {part.rank: [] for part in job.ranks}
    replica_messages: list[dict[int, list[Messages]]] = []
    for index, labels in enumerate(replicas):
        directory = log_dir / f"replica{index}"
        arguments = {
            "job": job.path,
            "log_dir": directory,
            "repeats": repeats,
            "inject": list(inject),
            "last_step": last_step,
        }
        results = run_ranks(
            "replay",
            run_rank_replay_task,
            labels,
            _same(arguments),
            directory,
            environment=comparable.pinned_environment(first.manifest.fingerprint),
            timeout=timeout,
        )
        structure = ranks_failure("the replay", results)
        if isinstance(structure, StructureError):
            raise structure
        refuse_unmatched_specs(
            [(label, rank, results[rank].value) for rank, label in enumerate(labels)], job.path
        )
        messages = {}
        for rank, label in enumerate(labels):
            run, found = _rank_run(job.rank(rank), label, results[rank])
            runs[rank].append(run)
            if found is not None:
                messages[rank] = found
        _write_replica_index(directory, job, labels, runs, index)
        replica_messages.append(messages)
        if on_done is not None:
            on_done(index, labels)
    report = _report(job, replicas, runs, replica_messages, repeats, log_dir, last_step, inject)
    if ledger:
        note_result(report.to_json())
    return report


def _same(arguments: dict) -> Callable[[int], dict]:
    """Every rank's task arguments (each rank finds its own part by its rank)."""
    return lambda _: arguments


def _rank_run(
    part: Bundle, label: str, result: DeviceResult
) -> tuple[DeviceRun, list[Messages] | None]:
    """One rank's run in a replica (its logs with its messages among their entries), and each
    repeat's messages."""
    value = result.value or {}
    run = DeviceRun(
        label,
        error=result.error.to_json() if result.error else None,
        warnings=value.get("warnings", []),
        injected=value.get("injected", []),
        fingerprint=value.get("fingerprint"),
        probe=value.get("probe"),
        identity=value.get("identity"),  # a rank on another node (`endings.exchange`)
    )
    if run.error is not None:
        return run, None
    run.log_paths = value["logs"]
    message_logs = [read_messages(Path(path)) for path in value["messages"]]
    run.logs = [
        with_messages(read_signature_log(Path(path)), messages)
        for path, messages in zip(run.log_paths, message_logs)
    ]
    judge_comparability(run, part, value)
    return run, message_logs


def _write_replica_index(
    directory: Path, job: JobBundle, labels: list[str], runs: dict[int, list[DeviceRun]], index: int
) -> None:
    """``replica.json``: what ``diff`` needs to read a replica's logs as one job."""
    ranks = []
    for rank, label in enumerate(labels):
        run = runs[rank][index]
        stems = [path.removesuffix(".sig.zst") for path in run.log_paths]
        ranks.append(
            {
                "rank": rank,
                "device": label,
                "logs": run.log_paths,
                "messages": [f"{stem}.messages.json" for stem in stems],
            }
        )
    document = {
        "schema": REPLICA_SCHEMA,
        "bundle": str(job.path),
        "world_size": job.world_size,
        "ranks": ranks,
    }
    (directory / REPLICA_FILE).write_text(json.dumps(document, indent=1))


# ---------------------------------------------------------------------------
# Under torchrun: one replica spread over several nodes.


def torchrun_replay(
    bundle: str | Path,
    log_dir: str | Path,
    *,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    timeout: float = UNKNOWN_STEP_TIMEOUT,
) -> None:
    """This process's rank of a replica that ``torchrun`` started (``python -m
    sdcreplay.distributed JOB LOGS``): rank r replays part r on ``cuda:LOCAL_RANK`` (or the
    CPU); rank 0 writes the replica index once every rank has written its logs, so
    ``sdcreplay diff JOB LOGS`` compares them (logs from several nodes gathered in LOGS)."""
    import torch.distributed as dist

    job = JobBundle.open(bundle)
    first = _check_job(job)
    kind = job.ranks[0].device.split(":")[0]
    label = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if kind == "cuda" else "cpu"
    determinism.pin_environment(first.manifest.fingerprint)
    join_group(label, backend_for([label]), GROUP_TIMEOUT_FACTOR * timeout)
    try:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        run_rank_replay_task(label, str(job.path), str(log_dir), 1, inject, last_step)
        dist.barrier()
        if dist.get_rank() == 0:
            labels = [part.device for part in job.ranks]
            _write_replica_index(Path(log_dir), job, labels, _expected_runs(job, log_dir), 0)
    finally:
        dist.destroy_process_group()


def _expected_runs(job: JobBundle, log_dir: str | Path) -> dict[int, list[DeviceRun]]:
    """Each rank's run as `run_rank_replay_task` names its logs (written on any node)."""
    return {
        part.rank: [
            DeviceRun(part.device, log_paths=[f"{Path(log_dir)}/rank{part.rank}.r0.sig.zst"])
        ]
        for part in job.ranks
    }


def main(argv: list[str]) -> int:
    """``python -m sdcreplay.distributed JOB LOGS [--inject SPEC]...`` under torchrun."""
    flags = argv[3::2]
    if len(argv) < 3 or len(argv) % 2 == 0 or any(flag != "--inject" for flag in flags):
        print("usage: python -m sdcreplay.distributed JOB LOGS [--inject SPEC]...", file=sys.stderr)
        return 2
    inject = argv[4::2]
    try:
        torchrun_replay(argv[1], argv[2], inject=inject)
    except SdcReplayError as exc:
        print(f"Error: {exc.message}\nHint: {exc.hint}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    # The task functions register in sdcreplay.replay.job, not in this __main__ copy of it.
    from sdcreplay.replay.job import main as run_main

    sys.exit(run_main(sys.argv))
