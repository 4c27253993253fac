"""Phase 1 at scale: the whole job replayed once, every data-parallel group fed one group's
batches, the peers voting (``sdcreplay replay JOB --same-batch [--from-rank R]``).

Fed rank R's batches and RNG states (each rank those of R's group's rank with its own
model-parallel coordinates: `ParallelLayout.counterpart`), data-parallel peers compute the same
values at every entry that is no shard of their own, so no spare replica and no second job is
needed: the odd rank is the one a majority of its peers disagrees with (`compare.peers`), and
every rank is also held to the record of the rank it was fed from, up to its first reduction
over peers (R's own group always; the others where parameters are replicated). Two peers of
replicated parameters (``dp=2 x tp=2``) are decided by that record check; with sharded
parameters and fewer than 3 peers, or no peer at all, the job is replayed as recorded and
voted with the record instead (today's rule), and the report says what was missing
(docs/at-scale.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.job_bundle import JobBundle
from ..bundle.layout import ParallelLayout, require_layout
from ..capture import comparable
from ..compare.logs import DeviceVerdict, Divergence
from ..compare.messages import Messages
from ..compare.peers import MAJORITY_PEERS, OddEntry, PeerVote, peer_vote, record_prefix_divergence
from ..errors import DeviceError, SdcReplayError, StructureError
from ..ledger.notes import note_result
from ..ledger.verdicts import incident_of
from . import kept_state
from .job import (
    _check_job,
    _rank_run,
    check_fault_ranks,
    replay_job,
    replica_devices,
    run_rank_replay_task,
)
from .job_report import JobReplayReport, ranks_failure
from .kept_state import KeptState
from .launch import run_ranks
from .replicas import (
    DeviceRun,
    caveat_for,
    default_log_dir,
    progress_timeout,
    refuse_unmatched_specs,
)


@dataclass
class SameBatchReport:
    """What a same-batch replay found (``sdcreplay.replay/1`` with ``mode: same_batch``)."""

    bundle: str
    layout: ParallelLayout
    from_rank: int
    log_dir: str
    runs: dict[int, DeviceRun]
    vote: PeerVote | None
    fallback: JobReplayReport | None = None
    missing: str | None = None  # why the peers could not vote (too few)
    caveat: str | None = None
    injected_specs: list[str] = field(default_factory=list)
    incident: str | None = None  # the job bundle's identity (ledger.verdicts.incident_of)
    recorded_faults: list[str] = field(default_factory=list)  # a drill job's (its ranks')
    kept_state: KeptState | None = None  # --keep-state: entering the first divergent step

    @property
    def verdict(self) -> str:
        if self.fallback is not None:
            return self.fallback.verdict
        if self.vote is None:
            return "error"
        return self.vote.verdict

    @property
    def suspects(self) -> list[str]:
        if self.fallback is not None:
            return self.fallback.suspects
        vote = self.vote
        if vote is not None and vote.verdict == "undecided":  # the peers that differ
            return [self.runs[rank].device for rank in self._tied_ranks()]
        return [self.runs[rank].device for rank in (vote.origins if vote else [])]

    def _tied_ranks(self) -> list[int]:
        """The ranks of peer classes whose logs differ (an undecided two-peer vote)."""
        tied = []
        for peers in self.layout.peer_classes():
            logs = [self.runs[rank].logs[0].steps for rank in peers if rank in self.runs]
            if any(steps != logs[0] for steps in logs):
                tied += peers
        return sorted(tied)

    @property
    def exit_code(self) -> int:
        if self.fallback is not None:
            return self.fallback.exit_code
        if self.vote is None:
            return 3
        return 0 if self.vote.verdict == "correct" else 1

    def failure(self) -> SdcReplayError | None:
        return self.fallback.failure() if self.fallback is not None else None

    def _rank_json(self, rank: int) -> dict:
        vote = self.vote
        odd = vote.odd.get(rank) if vote else None
        spread = vote.spread_from.get(rank) if vote else None
        tied = vote is not None and vote.verdict == "undecided" and rank in self._tied_ranks()
        verdict = (
            "spread"
            if spread is not None
            else "persistent"
            if vote and rank in vote.origins
            else "undecided"
            if tied
            else "correct"
        )
        return {
            "rank": rank,
            "coordinates": self.layout.coordinates_of(rank),
            "peers": self.layout.peers(rank),
            "fed_from": self.layout.counterpart(rank, self.from_rank),
            "verdict": verdict,
            **({} if spread is None else {"spread_from": spread}),
            "first_divergent_entry": None if odd is None else odd.to_json(),
            "devices": [self.runs[rank].to_json()] if rank in self.runs else [],
        }

    def to_json(self) -> dict:
        same_batch = {
            "from_rank": self.from_rank,
            "layout": self.layout.to_json(),
            "peer_classes": self.layout.peer_classes(),
            "missing": self.missing,
            "tie_break": None if self.missing else tie_break(self.layout),
        }
        if self.fallback is not None:
            body = self.fallback.to_json()
            origin = body.get("origin_rank")
            body["origin_coordinates"] = (
                None if origin is None else self.layout.coordinates_of(origin)
            )
            return {**body, "mode": "recorded", "same_batch": same_batch}
        vote = self.vote
        origins = vote.origins if vote else []
        odd = vote.odd if vote else {}
        return {
            "schema": "sdcreplay.replay/1",
            "bundle": self.bundle,
            "incident": self.incident,
            "job": True,
            "mode": "same_batch",
            "world_size": self.layout.world_size,
            "repeats": 1,
            "log_dir": self.log_dir,
            "verdict": self.verdict,
            "suspects": self.suspects,
            "odd_ranks": [
                {
                    "rank": rank,
                    "where": self.layout.describe(rank),
                    "device": self.runs[rank].device,
                    "first_divergent_entry": odd[rank].to_json(),
                }
                for rank in origins
            ],
            "unjudged_entries": vote.unjudged if vote else 0,
            "kept_state": self.kept_state.to_json() if self.kept_state else None,
            "same_batch": same_batch,
            "ranks": [self._rank_json(rank) for rank in range(self.layout.world_size)],
            "verified": self.caveat is None,
            "caveat": self.caveat,
            "inject": self.injected_specs,
            "recorded_faults": self.recorded_faults,
            "failed": [
                {"rank": rank, "device": run.device} for rank, run in self.runs.items() if run.error
            ],
        }


def default_source(job: JobBundle, from_rank: int | None) -> int:
    """Whose batches every group is fed: ``from_rank``, else the rank an alarm named (a ring
    dump's trigger ``rank``), else 0."""
    if from_rank is None:
        trigger = job.rank(0).manifest.trigger
        named = None if trigger is None else trigger.extra.get("rank")
        from_rank = named if isinstance(named, int) and 0 <= named < job.world_size else 0
    if not 0 <= from_rank < job.world_size:
        raise SdcReplayError(
            f"--from-rank {from_rank}: the job has ranks 0..{job.world_size - 1}",
            "Give one of the job's ranks (the one the alarm named, or leave it out for 0).",
        )
    return from_rank


def too_few_peers(layout: ParallelLayout) -> str | None:
    """Why the peers cannot vote, or None (module docstring)."""
    if not layout.data_parallel:
        return (
            f"the job's layout ({layout.shape()}, found from {layout.source}) names no "
            "data-parallel dimension: no rank is known to compute what another does"
        )
    peers = min(len(found) for found in layout.peer_classes())
    if peers < 2 or (peers < MAJORITY_PEERS and layout.sharded):
        return (
            f"{peers} data-parallel peer{'s' if peers > 1 else ''} per class "
            f"({layout.shape()}): a majority needs {MAJORITY_PEERS}"
            + (
                "; the record can decide between two only where parameters are replicated"
                if layout.sharded and peers == 2
                else ""
            )
        )
    return None


def tie_break(layout: ParallelLayout) -> str | None:
    """How two peers per class are decided, or None where a majority exists."""
    peers = min(len(found) for found in layout.peer_classes())
    if peers >= MAJORITY_PEERS:
        return None
    return (
        f"{peers} data-parallel peers per class ({layout.shape()}): no majority; the record "
        "decides between them where it vouches for one (up to the first reduction over "
        "peers), else undecided"
    )


def replay_same_batch(
    bundle: str | Path,
    devices: Sequence[str] | None = None,
    *,
    from_rank: int | None = None,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    log_dir: str | Path | None = None,
    timeout: float | None = None,
    ledger: bool = True,
    keep_state: str | Path | None = None,
) -> SameBatchReport:
    """Phase 1 (module docstring): one replay of the whole job on ``devices`` (one label per
    rank; default: the recorded devices), every group fed ``from_rank``'s group's batches;
    ``keep_state``: a directory for the state entering the first divergent step
    (`kept_state`), written when a rank is odd."""
    job = JobBundle.open(bundle)
    first = _check_job(job)
    layout = require_layout(job.layout, job.path)
    check_fault_ranks(inject, job.world_size)
    source = default_source(job, from_rank)
    replicas = replica_devices(job, devices)
    if len(replicas) != 1:
        raise DeviceError(
            f"--same-batch replays the job once: {len(replicas) * job.world_size} labels for "
            f"{job.world_size} ranks",
            f"Give {job.world_size} labels (one per rank), or none for the recorded devices.",
        )
    log_dir = Path(log_dir) if log_dir else default_log_dir(job.path)
    missing = too_few_peers(layout)
    if keep_state is not None and Path(keep_state).exists():  # before minutes of replay
        raise kept_state.unusable_directory(Path(keep_state), "it exists already")
    if missing is not None and keep_state is not None:
        raise SdcReplayError(
            f"--keep-state needs the peers' vote, and {missing}",
            "Leave out --keep-state (the job is replayed as recorded instead).",
            python_hint="Leave out keep_state= (the job is replayed as recorded instead).",
        )
    if missing is not None:
        fallback = replay_job(
            job.path, replicas[0], inject=inject, last_step=last_step, log_dir=log_dir,
            timeout=timeout, ledger=ledger,
        )  # fmt: skip
        return SameBatchReport(
            str(job.path), layout, source, str(log_dir), {}, None, fallback, missing
        )
    labels = replicas[0]
    directory = log_dir / "same-batch"
    arguments = {
        "job": job.path,
        "log_dir": directory,
        "repeats": 1,
        "inject": list(inject),
        "last_step": last_step,
        "feed_from": [layout.counterpart(rank, source) for rank in range(job.world_size)],
    }
    results = run_ranks(
        "replay",
        run_rank_replay_task,
        labels,
        lambda _: arguments,
        directory,
        environment=comparable.pinned_environment(first.manifest.fingerprint),
        timeout=timeout or max(progress_timeout(job.rank(r.rank)) for r in job.ranks),
    )
    structure = ranks_failure("the same-batch replay", results)
    if isinstance(structure, StructureError):
        raise structure
    refuse_unmatched_specs(
        [(label, rank, results[rank].value) for rank, label in enumerate(labels)], job.path
    )
    runs: dict[int, DeviceRun] = {}
    replayed: dict[int, Messages] = {}
    for rank, label in enumerate(labels):
        run, messages = _rank_run(job.rank(rank), label, results[rank])
        runs[rank] = run
        if messages:
            replayed[rank] = messages[0]
    report = SameBatchReport(
        str(job.path), layout, source, str(directory), runs, None,
        caveat=caveat_for(first), injected_specs=list(inject),
        incident=incident_of(job.manifest.manifest_sha256), recorded_faults=job.injected_faults,
    )  # fmt: skip
    failure = ranks_failure("the same-batch replay", results)
    if failure is not None:
        raise failure
    logs = {rank: run.logs[0] for rank, run in runs.items()}
    report.vote = vote = peer_vote(layout, logs, _against_record(job, layout, source, replayed))
    _judge_runs(report)
    if keep_state is not None and vote.origins:
        step = min(vote.odd[rank].step for rank in vote.origins)
        odd = sorted(set(vote.origins) | set(vote.spread_from))
        report.kept_state = kept_state.keep_state(
            job, layout, source, labels, step, odd, Path(keep_state), directory, timeout,
            list(inject),
        )  # fmt: skip
    if ledger:
        note_result(report.to_json())
    return report


def _against_record(
    job: JobBundle, layout: ParallelLayout, source: int, replayed: dict[int, Messages]
) -> dict[int, OddEntry]:
    """Each rank held to the record of the rank it was fed from, in the window's first step, up
    to its first reduction over the peers (`record_prefix_divergence`): the source group's
    ranks always, the others where parameters are replicated (`compare.peers`)."""
    odd = {}
    step = job.rank(source).steps[0].index
    held = range(layout.world_size) if not layout.sharded else layout.model_parallel_group(source)
    for rank in held:
        fed_from = job.rank(layout.counterpart(rank, source))
        found = record_prefix_divergence(fed_from.messages(), replayed.get(rank, {}), step)
        if found is not None:
            position, message = found
            name = (
                f"collective:{message.process_group}#{message.op_id}:{message.profiling_name}.input"
            )
            odd[rank] = OddEntry(step, position, name, 1, 1, against="record")
    return odd


def _judge_runs(report: SameBatchReport) -> None:
    """Each run's judgement as the ledger reads it: the origins ``persistent`` (at their first
    odd entry), the ranks it spread to ``spread``, the peers of an undecided tie
    ``undecided``, every other ``match``."""
    vote = report.vote
    assert vote is not None
    tied = report._tied_ranks() if vote.verdict == "undecided" else []
    for rank, run in report.runs.items():
        odd = vote.odd.get(rank)
        if rank in vote.spread_from:
            run.spread_from = vote.spread_from[rank]
        if rank in vote.origins and odd is not None:
            against = "the record" if odd.against == "record" else "the majority of its peers"
            where = Divergence(odd.step, odd.entry, against, "another value")
            run.judgement = DeviceVerdict("persistent", 1, 1, where, {odd.step: 1})
        elif rank in tied:
            run.judgement = DeviceVerdict("undecided", 1, 0, None, {})
        elif odd is None:
            run.judgement = DeviceVerdict("match", 1, 0, None, {})
