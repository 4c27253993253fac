"""What a job's replay found: the vote per rank, the origin, and the ranks it only spread to.

Every rank's runs over the replicas are voted on as single-process replay
votes on devices (`compare.logs.vote`); the origin rule (`compare.origin`)
then tells, replica by replica, which rank went wrong first, and a rank that
diverged only because a collective brought it that corruption is not a
suspect. Ranks that failed are named in one error, the first cause first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.job_bundle import JobBundle
from ..bundle.manifest import part_dir
from ..bundle.reader import ignored_environment
from ..capture.signature import SignatureLog
from ..compare.logs import RECORD, Consensus, compare_logs, vote
from ..compare.messages import Messages, recorded_log
from ..compare.origin import NO_ORIGIN, Origin, find_origin
from ..errors import SdcReplayError, StructureError
from ..ledger.verdicts import incident_of
from .launch import followed
from .replicas import DeviceRun, case_gaps, caveat_for, incomparable_failure
from .worker import DeviceFailure, DeviceResult

VERDICT_ORDER = ("persistent", "transient", "recording_suspect", "undecided", "incomparable")
"""The job's verdict is the first of these any rank has (else ``correct``)."""


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
    said = failure.said()
    return f"{failure.message}{status}{said[len(failure.message) :]}"


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
    incident: str | None = None  # the job bundle's identity (ledger.verdicts.incident_of)
    recorded_faults: list[str] = field(default_factory=list)  # a drill job's (its ranks')
    ignored_environment: list[str] = field(default_factory=list)  # reader.ignored_environment

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
        if self.verdict == "incomparable":
            judged = [
                (rank.rank, rank.consensus.incomparable)
                for rank in self.ranks
                if rank.consensus is not None and rank.consensus.incomparable
            ]
            incomparable = {
                f"rank {rank} {label}": differences
                for rank, found in judged
                for label, differences in found.items()
            }
            probed = str(Path(self.bundle) / part_dir(judged[0][0])) if judged else None
            return incomparable_failure(self.bundle, incomparable, probed)
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
            "incident": self.incident,
            "inject": self.injected_specs,
            "recorded_faults": self.recorded_faults,
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
            "ignored_environment": self.ignored_environment,
        }


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
        gaps = case_gaps(job.rank(part.rank))
        consensus = vote(record_log, healthy, incomparable, gaps) if healthy else None
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
        incident_of(job.manifest.manifest_sha256),
        job.injected_faults,
        ignored_environment(job.rank(0).manifest.workload),
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
