"""``sdcreplay diff`` on jobs: two job bundles, or a job bundle and a replica's log directory;
one rank's log against another's, or against its rank of a job.

A job is compared rank by rank, each rank's messages among its entries, and
the origin rule names the rank that left the other first. A replica's log
directory is read through the index (``replica.json``) its replay wrote; a job replay's log
directory (``JOB.replay/<run>/``) stands for its replica when it holds one. One rank's log (a
job's part ``JOB/ranks/00000R``, or a replay's ``rankR.r0.sig.zst`` beside its
``.messages.json``) is compared with its messages among its entries too; against a job, with
the job's part of the same rank.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..bundle.job_bundle import JobBundle, is_job_bundle
from ..bundle.reader import Bundle
from ..capture.signature import SignatureLog, read_signature_log
from ..errors import BundleError, SdcReplayError, StructureError
from ..storage.safeio import check_json_value, read_limited
from .logs import Comparison, compare_logs, load_log
from .logs import diff as diff_processes
from .messages import Messages, read_messages, with_messages
from .origin import Origin, find_origin

REPLICA_FILE = "replica.json"
"""What a replica's log directory holds, per rank: its signature logs and message logs."""
REPLICA_SCHEMA = "sdcreplay.job-replay/1"


def is_job_log(path: str | Path) -> bool:
    """A job bundle, or a replica's log directory (``replica.json``)."""
    path = Path(path)
    return is_job_bundle(path) or (path / REPLICA_FILE).is_file()


def replica_of(path: Path) -> Path:
    """A job replay's log directory as the replica it holds (``LOGS/replica0``); any other path
    as it is. Several replicas: say which."""
    if not path.is_dir() or is_job_log(path):
        return path
    replicas = sorted(p for p in path.glob("replica*") if (p / REPLICA_FILE).is_file())
    if len(replicas) > 1:
        raise BundleError(
            f"{path} holds the logs of {len(replicas)} replicas of a job replay",
            f"Name one: {' or '.join(str(r) for r in replicas[:3])}.",
        )
    return replicas[0] if replicas else path


@dataclass
class RankLog:
    """One rank's signature log with its messages among its entries."""

    rank: int
    log: SignatureLog
    messages: Messages


def rank_log(path: Path) -> RankLog | None:
    """A job's rank part, or a job replay's rank log (``rankR.rK.sig.zst`` beside its
    ``.messages.json``), as one rank's log; None for a single process's log."""
    if path.is_dir():
        with contextlib.suppress(BundleError):
            part = Bundle.open(path, verify=False)
            info = part.manifest.distributed
            if info is not None:
                messages = part.messages()
                return RankLog(info.rank, with_messages(load_log(path), messages), messages)
        return None
    beside = path.with_name(path.name.removesuffix(".sig.zst") + ".messages.json")
    if not path.name.endswith(".sig.zst") or not beside.is_file():
        return None
    log = load_log(path)
    if not isinstance(log.meta.get("rank"), int):
        return None
    messages = read_messages(beside)
    return RankLog(log.meta["rank"], with_messages(log, messages), messages)


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


def diff(
    first: str | Path, second: str | Path, plot: str | Path | None = None
) -> Comparison | JobComparison:
    """What ``sdcreplay diff`` does: two jobs rank by rank (`diff_jobs`); one rank's log against
    another's or against its rank of a job, messages included (`Comparison.ranks` names both);
    else two processes' logs (`logs.diff`)."""
    left, right = replica_of(Path(first)), replica_of(Path(second))
    jobs = is_job_log(left), is_job_log(right)
    if all(jobs):
        if plot is not None:
            raise SdcReplayError(
                "--plot draws one process's log; these are jobs",
                f"Plot one rank: diff {left}/ranks/00000R LOGS/replicaN/rankR.r0.sig.zst --plot P.",
            )
        return diff_jobs(left, right)
    ranks = (None if jobs[0] else rank_log(left)), (None if jobs[1] else rank_log(right))
    if any(jobs):
        single = ranks[1] if jobs[0] else ranks[0]
        if single is None:
            raise StructureError(
                f"{left if jobs[1] else right} is neither a job nor one rank's log, and "
                f"{right if jobs[1] else left} is a job",
                "Compare a job with a job (bundle or replica directory), or one rank with a "
                "rank: JOB/ranks/00000R, LOGS/replicaN/rankR.r0.sig.zst.",
            )
        job_logs, _ = load_job_logs(left if jobs[0] else right)
        if single.rank not in job_logs:
            raise StructureError(
                f"the job has no rank {single.rank} (it has {sorted(job_logs)})",
                "Compare a rank's log with the job it comes from.",
            )
        job_side = RankLog(single.rank, job_logs[single.rank], {})
        ranks = (job_side, single) if jobs[0] else (single, job_side)
    if ranks[0] is None or ranks[1] is None:
        return diff_processes(left, right, plot=plot)
    comparison = compare_logs(ranks[0].log, ranks[1].log)
    comparison.ranks = [ranks[0].rank, ranks[1].rank]
    if plot is not None:
        from .plot import plot_divergence_map

        plot_divergence_map(ranks[0].log, comparison, plot)
        comparison.plot = str(plot)
    return comparison
