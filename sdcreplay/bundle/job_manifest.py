"""A job bundle's own manifest (``sdcreplay.job/1``), which ties the ranks' parts into one job:
its typed objects and its rules. It sits below the bundle writer, which signs it as it signs a
bundle's manifest, and below the reader and writer of job bundles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import BundleError
from ..storage.safeio import check_json_value
from .layout import ParallelLayout
from .manifest import (
    JOB_SCHEMA,
    MANIFEST,
    MANIFEST_DIGEST,
    MANIFEST_FIELDS,
    MAX_JSON_DEPTH,
    MAX_WORLD_SIZE,
    RANKS,
    WorkloadRef,
    manifest_digest,
    part_dir,
)
from .rules import (
    BOOL,
    OBJECT,
    SHA256,
    Check,
    Record,
    _check_fields,
    _is_int,
    _require,
    choice,
    integer,
    nullable,
    optional,
    text,
)


@dataclass(kw_only=True)
class ProcessGroupRecord(Record):
    """A process group of the job: its id (creation order), name and member ranks."""

    RULES: ClassVar[dict[str, Check]] = {
        "pg_id": integer(0, MAX_WORLD_SIZE),
        "name": text(256),
        "ranks": Check(
            lambda v: (
                isinstance(v, list)
                and len(v) <= MAX_WORLD_SIZE
                and all(_is_int(r) and 0 <= r < MAX_WORLD_SIZE for r in v)
            ),
            "a list of ranks",
        ),
    }
    pg_id: int
    name: str
    ranks: list[int]


@dataclass(kw_only=True)
class RankRecord(Record):
    """A rank of the job: its device label, its part's directory, and (once the job closed)
    the SHA-256 its part's manifest has, which ties the part to this job."""

    RULES: ClassVar[dict[str, Check]] = {
        "rank": integer(0, MAX_WORLD_SIZE - 1),
        "device": text(64, r"[a-z]+(:\d{1,6})?"),
        "part": text(64, RANKS + r"/\d{6}"),
        MANIFEST_DIGEST: nullable(SHA256),
    }
    rank: int
    device: str
    part: str
    manifest_sha256: str | None = None


@dataclass(kw_only=True)
class JobManifest(Record):
    """A job bundle's ``manifest.json`` (schema ``sdcreplay.job/1``)."""

    schema: str = JOB_SCHEMA
    created: str | None = None
    complete: bool = False
    world_size: int
    backend: str
    process_groups: list[ProcessGroupRecord]
    ranks: list[RankRecord]
    workload: WorkloadRef
    layout: ParallelLayout | None = None  # absent in jobs recorded before it was written
    signature: str | None = None
    manifest_sha256: str | None = None

    @classmethod
    def from_json(cls, obj: Any) -> JobManifest:
        _validate_job_manifest(obj)
        return cls._read(
            obj,
            workload=WorkloadRef._read(obj["workload"]),
            process_groups=[ProcessGroupRecord._read(group) for group in obj["process_groups"]],
            ranks=[RankRecord._read(rank) for rank in obj["ranks"]],
            **(
                {"layout": ParallelLayout.from_json(obj["layout"])}
                if obj.get("layout") is not None
                else {}
            ),
        )


def _list_of_objects(limit: int) -> Check:
    return Check(
        lambda v: isinstance(v, list) and len(v) <= limit and all(isinstance(x, dict) for x in v),
        f"a list of at most {limit} objects",
    )


JOB_FIELDS: dict[str, Check] = {
    "schema": choice(JOB_SCHEMA),
    MANIFEST_DIGEST: SHA256,
    "created": optional(text(64)),
    "complete": BOOL,
    "world_size": integer(1, MAX_WORLD_SIZE),
    "backend": text(64, "[a-z0-9_:]+"),
    "process_groups": _list_of_objects(1 << 16),
    "ranks": _list_of_objects(MAX_WORLD_SIZE),
    "workload": OBJECT,
    "workload.ref": MANIFEST_FIELDS["workload.ref"],
    "workload.kwargs": MANIFEST_FIELDS["workload.kwargs"],
    "signature": optional(text(64, "[0-9a-f]{64}")),
    "layout": optional(OBJECT),
}


def _validate_job_manifest(manifest: Any) -> None:
    _require(isinstance(manifest, dict), "not a JSON object")
    check_json_value(manifest, MANIFEST, MAX_JSON_DEPTH)
    _check_fields(manifest, {"schema": choice(JOB_SCHEMA), MANIFEST_DIGEST: SHA256})
    if manifest[MANIFEST_DIGEST] != manifest_digest(manifest):
        raise BundleError(
            "the job manifest does not match its own SHA-256 (damaged or edited by hand)",
            "Restore the bundle from a copy or record it again; "
            "a bundle is evidence and is not edited.",
        )
    _check_fields(manifest, JOB_FIELDS)
    for position, group in enumerate(manifest["process_groups"]):
        _check_fields(group, ProcessGroupRecord.RULES, f"process_groups[{position}].")
    world_size = manifest["world_size"]
    for position, rank in enumerate(manifest["ranks"]):
        _check_fields(rank, RankRecord.RULES, f"ranks[{position}].")
        _require(rank["rank"] == position, f"ranks[{position}].rank is {rank['rank']}")
        _require(
            rank["part"] == part_dir(position),
            f"ranks[{position}].part is {rank['part']!r}, expected {part_dir(position)!r}",
        )
        _require(
            not manifest["complete"] or rank.get(MANIFEST_DIGEST) is not None,
            f"ranks[{position}].{MANIFEST_DIGEST} is null in a complete job",
        )
    _require(
        len(manifest["ranks"]) == world_size,
        f"{len(manifest['ranks'])} ranks listed for world_size {world_size}",
    )
    layout = manifest.get("layout")
    _require(
        layout is None or layout.get("world_size") == world_size,
        f"layout.world_size is not the job's world_size {world_size}",
    )
