"""Job bundles: one part per rank under one job manifest.

A job reads as the parts that exist, each validated as a bundle of its own and tied to the job;
rank 0 writes the job manifest at the start and at the end, so a job cut off mid-step still
reads. Each rank writes its own part with a ``BundleWriter``.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BundleError
from . import trust
from .job_manifest import JobManifest, ProcessGroupRecord, RankRecord
from .layout import ParallelLayout
from .manifest import JOB_SCHEMA, MANIFEST, PARTIAL_SUFFIX, RANKS, WorkloadRef, part_dir
from .reader import Bundle, _existing, _read_manifest_json
from .writer import _move_into_place, _prepare_directory, _save_signed


def is_job_bundle(path: str | Path) -> bool:
    """Whether ``path`` (or its ``.partial``) is a job bundle: its manifest's schema says so."""
    found = _existing(path)
    try:
        manifest = _read_manifest_json(found) if os.path.isdir(found) else None
    except (BundleError, OSError):
        return False
    return isinstance(manifest, dict) and manifest.get("schema") == JOB_SCHEMA


@dataclass(frozen=True)
class RankPart:
    """A rank of a job bundle and where its part lies."""

    rank: int
    device: str
    part: Path


class JobBundle:
    """A validated job bundle: its manifest, and every rank part that exists, each validated
    as a bundle of its own and tied to the job (its rank, and its manifest's SHA-256 once the
    job closed). A ``.partial`` job reads the parts that exist, each with its completed steps.
    """

    def __init__(self, path: Path, manifest: JobManifest, parts: dict[int, Bundle]):
        self.path = path
        self.manifest = manifest
        self._parts = parts

    @classmethod
    def open(cls, path: str | Path, verify: bool = True) -> JobBundle:
        found = _existing(path)
        if not os.path.isdir(found):
            raise BundleError(
                f"{str(found)[:300]} is not a bundle directory",
                "Give the directory `sdcreplay record --nproc N --out` wrote.",
                python_hint="Give the directory record_job(workload, out, nproc=N) wrote.",
            )
        manifest = JobManifest.from_json(_read_manifest_json(found))
        parts: dict[int, Bundle] = {}
        for entry in manifest.ranks:
            part_path = found / entry.part
            if not manifest.complete and not os.path.lexists(_existing(part_path) / MANIFEST):
                continue  # the job died before this rank wrote its part's manifest
            parts[entry.rank] = _open_part(part_path, manifest, entry, verify)
        return cls(found, manifest, parts)

    @property
    def world_size(self) -> int:
        return self.manifest.world_size

    @property
    def backend(self) -> str:
        return self.manifest.backend

    @property
    def layout(self) -> ParallelLayout | None:
        """The job's mesh and its data-parallel dimensions (None: recorded before it was)."""
        return self.manifest.layout

    @property
    def process_groups(self) -> list[ProcessGroupRecord]:
        return self.manifest.process_groups

    @property
    def complete(self) -> bool:
        return self.manifest.complete

    @property
    def ranks(self) -> list[RankPart]:
        return [RankPart(r.rank, r.device, self.path / r.part) for r in self.manifest.ranks]

    @property
    def parts(self) -> dict[int, Bundle]:
        """The parts that exist, by rank (all of them in a complete job)."""
        return dict(self._parts)

    def rank(self, rank: int) -> Bundle:
        """Rank ``rank``'s part, validated as a bundle."""
        part = self._parts.get(rank)
        if part is None:
            raise BundleError(
                f"the job {self.path} has no part for rank {rank} "
                f"(it has {sorted(self._parts)} of world size {self.world_size})",
                "A job cut off before that rank wrote a step holds none of its data; "
                "record the job again.",
            )
        return part

    @property
    def injected_faults(self) -> list[str]:
        """The faults any rank's recording device had injected: a drill job (empty: none)."""
        specs = [spec for part in self.parts.values() for spec in part.injected_faults]
        return list(dict.fromkeys(specs))

    @property
    def trusted(self) -> bool:
        return trust.is_trusted(self.manifest.workload.ref, self.manifest.to_json())

    def require_trusted(self) -> None:
        trust.require_trusted(self.manifest.workload.ref, self.manifest.to_json())


def _open_part(path: Path, job: JobManifest, entry: RankRecord, verify: bool) -> Bundle:
    """A rank's part: a bundle whose ``distributed`` names this rank of this job."""
    part = Bundle.open(path, verify=verify)
    info = part.manifest.distributed
    if info is None or (info.rank, info.world_size) != (entry.rank, job.world_size):
        raise BundleError(
            f"{entry.part} is not rank {entry.rank} of a {job.world_size}-rank job "
            f"(its manifest says {None if info is None else info.to_json()})"
        )
    if entry.manifest_sha256 is not None and part.manifest.manifest_sha256 != entry.manifest_sha256:
        raise BundleError(
            f"{entry.part}'s manifest is not the one the job manifest lists "
            "(a part from another job, or edited)"
        )
    if (part.manifest.workload.ref, part.manifest.workload.kwargs) != (
        job.workload.ref,
        job.workload.kwargs,
    ):
        raise BundleError(f"{entry.part} names another workload than its job manifest")
    return part


class JobWriter:
    """Rank 0's side of a job bundle: the job manifest, written at the start (so a job cut off
    mid-step reads as the parts that exist) and at ``close`` (every part's manifest SHA-256).
    Each rank writes its own part with a ``BundleWriter`` at ``part_path(rank)``."""

    def __init__(
        self,
        path: Path,
        *,
        world_size: int,
        backend: str,
        process_groups: list[ProcessGroupRecord],
        devices: list[str],
        workload: WorkloadRef,
        layout: ParallelLayout | None = None,
        overwrite: bool = False,
    ):
        self.final_path = Path(path)
        self.path = job_partial_path(self.final_path)
        self._overwrite = overwrite
        self.moved_aside = _prepare_directory(self.final_path, self.path, overwrite, RANKS)
        self.manifest = JobManifest(
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            world_size=world_size,
            backend=backend,
            process_groups=process_groups,
            ranks=[
                RankRecord(rank=rank, device=device, part=part_dir(rank))
                for rank, device in enumerate(devices)
            ],
            workload=workload,
            layout=layout,
            absent=frozenset() if layout is not None else frozenset({"layout"}),
        )
        self._save(durable=True)

    def _save(self, durable: bool = False) -> None:
        _save_signed(self.manifest, self.path, durable)

    def close(self) -> Path:
        """Tie every (closed) part to the job, mark it complete and give it its name."""
        messages = 0
        for entry in self.manifest.ranks:
            part = Bundle.open(self.path / entry.part, verify=False)
            if not part.complete:
                raise BundleError(f"rank {entry.rank}'s part did not close; the job stays partial")
            entry.manifest_sha256 = part.manifest.manifest_sha256
            messages += sum(step.messages or 0 for step in part.steps)
        self.manifest.complete = True
        self._save(durable=True)
        self.moved_aside += _move_into_place(self.path, self.final_path, self._overwrite)
        alone = isolated_ranks(self.manifest.world_size, messages)
        if alone is not None:
            warnings.warn(f"sdcreplay: the job bundle {self.final_path}: {alone}", stacklevel=3)
        return self.final_path


def isolated_ranks(world_size: int, messages: int) -> str | None:
    """What a job of several ranks whose recorded steps logged no message is (None: not
    that): ranks that trained alone, each its own model, which nobody meant to record as one
    job (`record` warns, `info` says it)."""
    if world_size < 2 or messages:
        return None
    return (
        f"its {world_size} ranks exchanged no message in any recorded step (no DDP, FSDP or "
        "other collective): each rank trained alone, on a model of its own (e.g. Accelerate "
        f"started without its launcher, or a model never wrapped for data parallelism): the "
        f"job holds {world_size} separate trainings, not one"
    )


def job_partial_path(path: Path) -> Path:
    return path.with_name(path.name + PARTIAL_SUFFIX)


def part_path(job: Path, rank: int) -> Path:
    """Where rank ``rank`` writes its part (``BundleWriter`` adds ``.partial`` until it
    closes) while the job at ``job`` is recorded."""
    return job_partial_path(Path(job)) / part_dir(rank)


def job_of_part(part: Bundle) -> Path | None:
    """The job a rank's part lies in (``JOB/ranks/00000R``), named as the part's path names it
    where it can be; None for a single process's bundle."""
    if part.manifest.distributed is None:
        return None
    for job in (part.path.parent.parent, part.path.absolute().parent.parent):
        if is_job_bundle(job):
            return job
    return None
