"""Multi-rank jobs: record one, replay every rank, and name the rank where corruption began.

A job bundle (`bundle.JobBundle`) holds one part per rank, each with its
message-order log (`collectives.Message`). `record_job` starts the ranks under
PyTorch's elastic launcher (`launch.py`), each driving the workload under a
Recorder. `replay_job` replays whole replicas of the job: each rank is a
`ReplaySession` on its part (the recorded message order is enforced there; a
different collective or order is a `MessageOrderError`, a structural
divergence), and every rank's signatures and messages are compared with the
record and voted on per rank, as single-process replay does.

Origin (phase 1): the gradient all-reduce spreads one rank's wrong value to
every rank within a step, so the rank whose signatures differ is not the
answer. The first message, in step and issue order, whose *input* digest
differs on one rank while the other ranks' inputs match names the rank whose
computation went wrong before it (`origin_rank`); every rank that differs
after that is `spread_ranks`. Device labels map to replicas and ranks in
consecutive groups of ``world_size`` labels (docs/distributed.md).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bundle.manifest import (
    Bundle,
    CheckpointState,
    JobBundle,
    claim_output,
    is_job_bundle,
    job_partial_path,
    verify_checkpoint,
)
from ..capture import determinism
from ..capture.collectives import Message
from ..capture.faults import distributed_rank, parse_specs
from ..capture.signature import SignatureLog, read_signature_log, write_signature_log
from ..compare.logs import RECORD, Comparison, Consensus, compare_logs, vote
from ..devices import torch_device, validate_label
from ..errors import BundleError, DeviceError, FaultSpecError, SdcReplayError, StructureError
from ..heartbeat import HEARTBEAT
from ..recording.recorder import RecordSummary, check_dump_on, record
from ..storage.safeio import check_json_value, read_limited
from .launch import GROUP_TIMEOUT_FACTOR, backend_for, followed, join_group, run_ranks
from .processes import UNKNOWN_STEP_TIMEOUT
from .session import (
    DeviceRun,
    caveat_for,
    default_log_dir,
    progress_timeout,
    refuse_unmatched_specs,
    replay_on_device,
)
from .worker import DeviceFailure, DeviceResult, device_task

REPLICA_FILE = "replica.json"
"""What a replica's log directory holds, per rank: its signature logs and message logs."""
REPLICA_SCHEMA = "sdcreplay.job-replay/1"
MESSAGES_SCHEMA = "sdcreplay.messages/1"
MAX_MESSAGE_LOG_BYTES = 256 * 1024 * 1024
VERDICT_ORDER = ("persistent", "transient", "recording_suspect", "undecided", "incomparable")
"""The job's verdict is the first of these any rank has (else ``correct``)."""

Messages = dict[int, list[Message]]
"""One rank's messages, per step."""


# ---------------------------------------------------------------------------
# Messages as comparable entries, and the origin rule.


def message_entries(messages: Sequence[Message]) -> list[tuple[str, str]]:
    """A step's messages as signature entries (``collective:PG#OP_ID:NAME.input``), so the
    vote judges them with the layers' entries."""
    entries = []
    for message in messages:
        name = f"collective:{message.process_group}#{message.op_id}:{message.profiling_name}"
        entries.append((f"{name}.input", message.input_digest or "none"))
        entries.append((f"{name}.output", message.output_digest or "none"))
    return entries


def with_messages(log: SignatureLog, messages: Messages) -> SignatureLog:
    """``log`` with each step's messages after its entries."""
    steps = {
        step: list(entries) + message_entries(messages.get(step, []))
        for step, entries in log.steps.items()
    }
    return SignatureLog(meta=dict(log.meta), steps=steps)


def recorded_log(part: Bundle) -> SignatureLog:
    """A rank's recorded signature log with its messages among its entries (as a replay's)."""
    return with_messages(part.signature_log(), part.messages())


@dataclass(frozen=True)
class Origin:
    """Where a replica (or a second log) first leaves the record, rank by rank."""

    origin_rank: int | None
    first_divergent_message: dict | None
    spread_ranks: list[int]

    @property
    def diverged(self) -> bool:
        return self.origin_rank is not None or bool(self.spread_ranks)

    def to_json(self) -> dict:
        return {
            "origin_rank": self.origin_rank,
            "first_divergent_message": self.first_divergent_message,
            "spread_ranks": self.spread_ranks,
        }


NO_ORIGIN = Origin(None, None, [])


def find_origin(
    recorded: dict[int, Messages], replayed: dict[int, Messages], diverged: set[int]
) -> Origin:
    """The origin rule (module docstring). ``diverged``: ranks whose signatures differ.

    Messages are matched per step by process group and ``op_id`` (the same call on every
    rank of the group) and taken in step, then issue order. The first one that differs
    anywhere is the first divergent message: when only inputs differ there and on exactly
    one rank, that rank is the origin; several at once, or outputs alone (the collective
    itself delivered something else), name no origin. Without any message difference, a
    single rank whose signatures differ is the origin (its corruption reached no message).
    """
    slots: dict[tuple[int, int, int], dict[int, tuple[Message, Message]]] = {}
    for rank, steps in recorded.items():
        for step, messages in steps.items():
            for mine, theirs in zip(messages, replayed.get(rank, {}).get(step, [])):
                slots.setdefault((step, mine.pg_id, mine.op_id), {})[rank] = (mine, theirs)

    def issue_order(key: tuple[int, int, int]) -> tuple:
        return (key[0], min(pair[0].record_id for pair in slots[key].values()), key[1], key[2])

    differing = set(diverged)
    first: tuple[int | None, dict] | None = None
    for key in sorted(slots, key=issue_order):
        pairs = slots[key]
        inputs = sorted(r for r, (a, b) in pairs.items() if a.input_digest != b.input_digest)
        outputs = sorted(r for r, (a, b) in pairs.items() if a.output_digest != b.output_digest)
        differing.update(inputs + outputs)
        if first is None and (inputs or outputs):
            ranks = inputs or outputs
            origin = inputs[0] if len(inputs) == 1 else None
            first = (origin, _message_json(pairs[ranks[0]][0], ranks[0], inputs, outputs))
    if first is None:
        origin = next(iter(diverged)) if len(diverged) == 1 else None
        return Origin(origin, None, sorted(differing - {origin}))
    return Origin(first[0], first[1], sorted(differing - {first[0]}))


def _message_json(message: Message, rank: int, inputs: list[int], outputs: list[int]) -> dict:
    return {
        "rank": rank,
        "step": message.step,
        "record_id": message.record_id,
        "collective_seq_id": message.collective_seq_id,
        "p2p_seq_id": message.p2p_seq_id,
        "op_id": message.op_id,
        "profiling_name": message.profiling_name,
        "process_group": message.process_group,
        "pg_id": message.pg_id,
        "which": "input" if inputs else "output",
        "input_differs": inputs,
        "output_differs": outputs,
    }


# ---------------------------------------------------------------------------
# A replay's message log (one JSON file per rank and repeat).


def write_messages(path: Path, rank: int, messages: Messages) -> None:
    document = {
        "schema": MESSAGES_SCHEMA,
        "rank": rank,
        "steps": {str(step): [m.to_json() for m in found] for step, found in messages.items()},
    }
    path.write_text(json.dumps(document))


def read_messages(path: Path) -> Messages:
    """A replay's message log; a damaged or foreign file is a BundleError (exit 3)."""
    try:
        document = json.loads(read_limited(path, MAX_MESSAGE_LOG_BYTES, "message log"))
        check_json_value(document, f"message log {path}")
        if not isinstance(document, dict) or document.get("schema") != MESSAGES_SCHEMA:
            raise ValueError(f"not a message log of schema {MESSAGES_SCHEMA}")
        return {
            int(step): [Message.from_json(m) for m in found]
            for step, found in document["steps"].items()
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BundleError(
            f"message log {path} is damaged: {exc}",
            "Give a replay's log directory as sdcreplay wrote it (or replay again).",
        ) from exc


# ---------------------------------------------------------------------------
# Inside a rank.


def this_rank() -> int:
    """This process's rank; a rank task outside a job is the tool's mistake."""
    rank = distributed_rank()
    if rank is None:
        raise SdcReplayError("a rank task ran outside a torch.distributed job")
    return rank


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
    )
    return summary.to_json()


@device_task
def run_rank_replay_task(
    device: str,
    job: str,
    log_dir: str,
    repeats: int,
    inject: Sequence[str] = (),
    last_step: int | None = None,
) -> dict:
    """One rank of a replica: replay its part ``repeats`` times; signature and message logs."""
    rank = this_rank()
    part = JobBundle.open(job).rank(rank)
    logs, message_logs, injected = [], [], []
    warnings: list[str] = []
    unmatched: list[dict] | None = None
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
    return {
        "unmatched": unmatched or [],
        "logs": logs,
        "messages": message_logs,
        "warnings": warnings,
        "injected": injected,
        "fingerprint": determinism.fingerprint(torch_device(device)),
    }


# ---------------------------------------------------------------------------
# Recording.


@dataclass
class JobRecordSummary(RecordSummary):
    """What ``sdcreplay record --nproc N`` wrote: rank 0's summary, and every rank's."""

    world_size: int = 1
    ranks: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return {**super().to_json(), "world_size": self.world_size, "ranks": self.ranks}


def check_fault_ranks(inject: Sequence[str], world_size: int) -> None:
    """Refuse a fault spec (``--inject`` or SDCREPLAY_INJECT) for a rank the job does not have."""
    for spec in parse_specs(inject):
        if spec.rank is not None and spec.rank >= world_size:
            raise FaultSpecError(
                f"fault spec {str(spec)!r} names rank {spec.rank}, but the job has ranks "
                f"0..{world_size - 1}",
                "Give rank= one of the job's ranks (`sdcreplay info JOB` lists them).",
            )


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
    }
    logs = out.with_name(out.name + ".logs")
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


def ranks_failure(what: str, results: dict[int, DeviceResult]) -> SdcReplayError | None:
    """One error naming the rank that failed first (the others failed after it), or None.
    A rank that issued another collective than the record is a StructureError."""
    failures = {rank: r.error for rank, r in sorted(results.items()) if r.error is not None}
    if not failures:
        return None
    order = [f for f in failures.values() if f.kind == "MessageOrderError"]
    if order:
        return StructureError(order[0].message, order[0].hint)
    causes = {rank: f for rank, f in failures.items() if not followed(f)} or failures
    text = "; ".join(_failure_text(failure) for failure in causes.values())
    others = sorted(set(failures) - set(causes))
    after = f" (then rank{'s' if len(others) > 1 else ''} {others} ended)" if others else ""
    logs = ", ".join(f.log for f in causes.values() if f.log)
    hint = next(iter(causes.values())).hint or ""
    return SdcReplayError(f"{what} failed: {text}{after}", f"{hint} Logs: {logs}.".strip())


def _failure_text(failure: DeviceFailure) -> str:
    """Its message, with its exit status and, where the message does not say why (a process
    that died without a word), its last stderr line."""
    status = "" if failure.exit_status is None else f" [exit status {failure.exit_status}]"
    last = failure.stderr_tail.splitlines()[-1] if failure.stderr_tail else ""
    said = not last or last.split(": ", 1)[-1][:60] in failure.message
    return f"{failure.message}{status}" + ("" if said else f": {last}")


# ---------------------------------------------------------------------------
# Replay.


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
        )
    groups = [labels[start : start + size] for start in range(0, len(labels), size)]
    for group in groups:
        require_own_gpus(group)
    for rank in range(size):
        column = [group[rank] for group in groups]
        if len(set(column)) != len(column):
            raise DeviceError(
                f"rank {rank} would replay on {column[0]} in two replicas",
                "Give each replica's rank its own label: cpu:0, cpu:1, ...",
            )
    return groups


@dataclass
class RankReplay:
    """One rank of the job: its run in each replica, and the vote on its entries."""

    rank: int
    runs: list[DeviceRun]
    consensus: Consensus | None
    device: str = ""  # where this rank was recorded
    record_spread_from: int | None = None  # the record diverged only by the origin's spread

    @property
    def suspects(self) -> list[str]:
        """Whom this rank's vote accuses, less the runs a collective only passed corruption to
        (``spread``)."""
        if self.consensus is None:
            return []
        spread = {run.device for run in self.runs if run.spread_from is not None}
        if self.record_spread_from is not None:
            spread.add(RECORD)
        return [
            f"{RECORD}:rank{self.rank} ({self.device})" if suspect == RECORD else suspect
            for suspect in self.consensus.suspects
            if suspect not in spread
        ]

    @property
    def record_verdict(self) -> str:
        judgement = self.consensus.voters.get(RECORD) if self.consensus else None
        return judgement.verdict if judgement else "match"

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "record": {
                "verdict": "spread" if self.record_spread_from is not None else self.record_verdict,
                **(
                    {}
                    if self.record_spread_from is None
                    else {"spread_from": self.record_spread_from}
                ),
            },
            "devices": [run.to_json() for run in self.runs],
            "consensus": (
                {**self.consensus.to_json(), "suspects": self.suspects} if self.consensus else None
            ),
        }


@dataclass
class JobReplayReport:
    """What ``sdcreplay replay`` on a job bundle found (``sdcreplay.replay/1`` with ranks)."""

    bundle: str
    world_size: int
    repeats: int
    log_dir: str
    replicas: list[dict]  # index, devices, log_dir, and the replica's origin
    ranks: list[RankReplay]
    origin: Origin
    caveat: str | None = None
    injected_specs: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        verdicts = {r.consensus.verdict for r in self.ranks if r.consensus is not None}
        if not verdicts:
            return "error"
        return next((v for v in VERDICT_ORDER if v in verdicts), "correct")

    @property
    def suspects(self) -> list[str]:
        """The devices a vote accuses, less those a collective only passed corruption to."""
        return sorted({suspect for rank in self.ranks for suspect in rank.suspects})

    @property
    def failed(self) -> list[tuple[int, DeviceRun]]:
        return [(rank.rank, run) for rank in self.ranks for run in rank.runs if run.error]

    @property
    def injection_missed(self) -> bool:
        return bool(self.injected_specs) and not any(
            fired for rank in self.ranks for run in rank.runs for fired in run.injected
        )

    @property
    def exit_code(self) -> int:
        if self.verdict in ("incomparable", "error"):
            return 3
        if self.verdict != "correct":
            return 1
        return 3 if self.failed else 0

    def failure(self) -> SdcReplayError | None:
        """Why the replay could not give a full answer (exit 3), or None."""
        if not self.failed or self.exit_code != 3:
            return None
        results = {
            rank: DeviceResult(error=DeviceFailure(**(run.error or {})))
            for rank, run in self.failed
        }
        return ranks_failure("the replay", results)

    def to_json(self) -> dict:
        suspects = self.suspects
        return {
            "schema": "sdcreplay.replay/1",
            "bundle": self.bundle,
            "job": True,
            "world_size": self.world_size,
            "repeats": self.repeats,
            "log_dir": self.log_dir,
            "verdict": self.verdict,
            "suspects": suspects,
            **self.origin.to_json(),
            "replicas": self.replicas,
            "ranks": [rank.to_json() for rank in self.ranks],
            "verified": self.caveat is None,
            "caveat": self.caveat,
            "failed": [{"rank": rank, "device": run.device} for rank, run in self.failed],
        }


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
    determinism.check_environment(first.manifest.determinism.to_json())
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
) -> JobReplayReport:
    """Replay every rank of a job bundle, one replica after another, and vote per rank.

    ``devices``: see `replica_devices`. ``on_done(replica, labels)`` as each
    replica ends. ``timeout``: seconds the job may go without progress
    (default: from the recorded step times).
    """
    job = JobBundle.open(bundle)
    first = _check_job(job)
    check_fault_ranks(inject, job.world_size)
    replicas = replica_devices(job, devices)
    log_dir = Path(log_dir) if log_dir else default_log_dir(job.path)
    timeout = timeout or max(progress_timeout(job.rank(part.rank)) for part in job.ranks)
    runs: dict[int, list[DeviceRun]] = {part.rank: [] for part in job.ranks}
    replica_messages: list[dict[int, list[Messages]]] = []
    for index, labels in enumerate(replicas):
        directory = log_dir / f"replica{index}"
        arguments = {
            "job": str(job.path),
            "log_dir": str(directory),
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
            environment=determinism.pinned_environment(first.manifest.fingerprint),
            timeout=timeout,
        )
        structure = ranks_failure("the replay", results)
        if isinstance(structure, StructureError):
            raise structure
        refuse_unmatched_specs(
            [(label, rank, results[rank].value) for rank, label in enumerate(labels)]
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
    return _report(job, replicas, runs, replica_messages, repeats, log_dir, last_step, inject)


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
    )
    if run.error is not None:
        return run, None
    run.log_paths = value["logs"]
    message_logs = [read_messages(Path(path)) for path in value["messages"]]
    run.logs = [
        with_messages(read_signature_log(Path(path)), messages)
        for path, messages in zip(run.log_paths, message_logs)
    ]
    run.differences = determinism.fingerprint_differences(
        part.manifest.fingerprint, run.fingerprint
    )
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


def _mark_spread(ranks: list[RankReplay], replica: int, origin: Origin) -> None:
    """A rank that diverged only because a collective brought it the origin rank's corruption
    is not a suspect: the device it ran on computed what it was given. Without an origin (no
    single rank went first) every diverging device stays a suspect."""
    if origin.origin_rank is None:
        return
    for rank in ranks:
        if rank.rank not in origin.spread_ranks:
            continue
        run = rank.runs[replica] if replica < len(rank.runs) else None
        if run is not None and run.error is None and run.verdict in ("persistent", "intermittent"):
            run.spread_from = origin.origin_rank
        if rank.record_verdict in ("persistent", "intermittent"):  # the record is the odd one
            rank.record_spread_from = origin.origin_rank


def _report(
    job: JobBundle,
    replicas: list[list[str]],
    runs: dict[int, list[DeviceRun]],
    replica_messages: list[dict[int, list[Messages]]],
    repeats: int,
    log_dir: Path,
    last_step: int | None,
    inject: Sequence[str],
) -> JobReplayReport:
    recorded_messages = {part.rank: job.rank(part.rank).messages() for part in job.ranks}
    ranks = []
    record_logs = {}
    for part in job.ranks:
        record_log = recorded_log(job.rank(part.rank))
        if last_step is not None:
            record_log.steps = {s: e for s, e in record_log.steps.items() if s <= last_step}
        record_logs[part.rank] = record_log
        healthy = {run.device: run.logs for run in runs[part.rank] if run.error is None}
        incomparable = {run.device: run.differences for run in runs[part.rank] if run.differences}
        consensus = vote(record_log, healthy, incomparable) if healthy else None
        for run in runs[part.rank]:
            if consensus is not None and run.device in consensus.voters:
                run.judgement = consensus.voters[run.device]
        ranks.append(RankReplay(part.rank, runs[part.rank], consensus, part.device))
    recorded = _upto(recorded_messages, last_step)
    replica_reports = []
    origins = []
    for index, labels in enumerate(replicas):
        repeat, origin = _replica_origin(ranks, index, record_logs, recorded, replica_messages)
        origins.append(origin)
        _mark_spread(ranks, index, origin)
        replica_reports.append(
            {
                "index": index,
                "devices": labels,
                "log_dir": str(log_dir / f"replica{index}"),
                "repeat": repeat,
                **origin.to_json(),
            }
        )
    return JobReplayReport(
        str(job.path),
        job.world_size,
        repeats,
        str(log_dir),
        replica_reports,
        ranks,
        next((origin for origin in origins if origin.diverged), NO_ORIGIN),
        caveat_for(job.rank(0)),
        list(inject),
    )


def _replica_origin(
    ranks: list[RankReplay],
    index: int,
    record_logs: dict[int, SignatureLog],
    recorded: dict[int, Messages],
    replica_messages: list[dict[int, list[Messages]]],
) -> tuple[int | None, Origin]:
    """The origin in replica ``index``'s first repeat that left the record (its ranks repeat
    together), and that repeat; (None, NO_ORIGIN) when a rank failed or none left it."""
    messages = replica_messages[index]
    if len(messages) < len(ranks):
        return None, NO_ORIGIN
    for repeat in range(len(next(iter(messages.values())))):
        diverged = {
            rank.rank
            for rank in ranks
            if not compare_logs(
                record_logs[rank.rank],
                rank.runs[index].logs[repeat],
                sorted(record_logs[rank.rank].steps),
            ).identical
        }
        origin = find_origin(
            recorded, {r: found[repeat] for r, found in messages.items()}, diverged
        )
        if origin.diverged:
            return repeat, origin
    return None, NO_ORIGIN


def _upto(messages: dict[int, Messages], last_step: int | None) -> dict[int, Messages]:
    if last_step is None:
        return messages
    return {r: {s: m for s, m in steps.items() if s <= last_step} for r, steps in messages.items()}


# ---------------------------------------------------------------------------
# diff on jobs: two job bundles, or a job bundle and a replica's log directory.


def is_job_log(path: str | Path) -> bool:
    """A job bundle, or a replica's log directory (``replica.json``)."""
    path = Path(path)
    return is_job_bundle(path) or (path / REPLICA_FILE).is_file()


def load_job_logs(path: str | Path) -> tuple[dict[int, SignatureLog], dict[int, Messages]]:
    """Each rank's signature log (its messages among its entries) and its messages."""
    path = Path(path)
    if is_job_bundle(path):
        job = JobBundle.open(path)
        logs, messages = {}, {}
        for part in job.ranks:
            bundle = job.rank(part.rank)
            messages[part.rank] = bundle.messages()
            log = bundle.signature_log()
            log.meta.setdefault(
                "workload", {"ref": bundle.workload_ref, "kwargs": bundle.workload_kwargs}
            )
            logs[part.rank] = with_messages(log, messages[part.rank])
        return logs, messages
    try:
        document = json.loads(read_limited(path / REPLICA_FILE, 1 << 20, "replica index"))
        check_json_value(document, f"replica index {path / REPLICA_FILE}")
        if document.get("schema") != REPLICA_SCHEMA:
            raise ValueError(f"not of schema {REPLICA_SCHEMA}")
        entries = {int(rank["rank"]): rank for rank in document["ranks"]}
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        raise BundleError(
            f"{path / REPLICA_FILE} is not a replica index: {exc}",
            "Give a job bundle or a replica directory a job replay wrote (LOGS/replica0).",
        ) from exc
    logs, messages = {}, {}
    for rank, entry in entries.items():
        messages[rank] = read_messages(Path(entry["messages"][0]))
        logs[rank] = with_messages(read_signature_log(Path(entry["logs"][0])), messages[rank])
    return logs, messages


@dataclass
class JobComparison:
    """``sdcreplay diff`` of two jobs: each rank's comparison, and the origin."""

    ranks: dict[int, Comparison]
    origin: Origin

    @property
    def identical(self) -> bool:
        return all(comparison.identical for comparison in self.ranks.values())

    @property
    def exit_code(self) -> int:
        return 0 if self.identical else 1

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.diff/1",
            "job": True,
            "identical": self.identical,
            "world_size": len(self.ranks),
            **self.origin.to_json(),
            "ranks": [
                {"rank": rank, **{k: v for k, v in comparison.to_json().items() if k != "schema"}}
                for rank, comparison in self.ranks.items()
            ],
        }


def diff_jobs(first: str | Path, second: str | Path) -> JobComparison:
    """Compare two jobs rank by rank (structure first, as `compare_logs`), then the origin."""
    left_logs, left_messages = load_job_logs(first)
    right_logs, right_messages = load_job_logs(second)
    if sorted(left_logs) != sorted(right_logs):
        raise StructureError(
            f"the jobs have different ranks: {sorted(left_logs)} vs {sorted(right_logs)}",
            "Compare runs of the same job (the same world size).",
        )
    ranks = {rank: compare_logs(left_logs[rank], right_logs[rank]) for rank in sorted(left_logs)}
    diverged = {rank for rank, comparison in ranks.items() if not comparison.identical}
    return JobComparison(ranks, find_origin(left_messages, right_messages, diverged))


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
