"""``sdcreplay diff`` on jobs: two job bundles, or a job bundle and a replica's log directory.

A job is compared rank by rank, each rank's messages among its entries, and
the origin rule names the rank that left the other first. A replica's log
directory is read through the index (``replica.json``) its replay wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..bundle.job_bundle import JobBundle, is_job_bundle
from ..capture.signature import SignatureLog, read_signature_log
from ..errors import BundleError, StructureError
from ..storage.safeio import check_json_value, read_limited
from .logs import Comparison, compare_logs
from .messages import Messages, read_messages, with_messages
from .origin import Origin, find_origin

REPLICA_FILE = "replica.json"
"""What a replica's log directory holds, per rank: its signature logs and message logs."""
REPLICA_SCHEMA = "sdcreplay.job-replay/1"


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
