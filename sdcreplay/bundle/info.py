"""What ``sdcreplay info`` shows of a bundle or a job: its facts, once every file is verified.

Like the reader, it imports no torch: reading a bundle's facts stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..capture.comparable import must_match
from ..errors import BundleError
from .job_bundle import JobBundle, is_job_bundle, job_of_part
from .manifest import JOB_SCHEMA, WorkloadRef
from .reader import Bundle, workload_named


@dataclass
class BundleInfo:
    """What ``sdcreplay info`` shows (``sdcreplay.info/1``); every file was verified first."""

    bundle: str
    bundle_schema: str
    complete: bool
    created: str | None
    workload: dict
    device: str
    device_type: str
    digest: str | None
    state: dict
    steps: list[dict]
    state_objects: list[str]
    verification: dict
    entries: int
    files: int
    size_bytes: int
    integrity: str
    environment: dict
    determinism: dict
    fingerprint: dict | None
    must_match: dict
    trusted: bool
    signature_level: str = "layer"  # what the signature log holds: layer | boundary
    trigger: dict | None = None
    probe: dict | None = None  # the kernel probe: calls, skipped (None: the bundle has none)
    compiled: list[dict] | None = None  # the compiled regions and their code digests
    injected_faults: list[str] = field(default_factory=list)  # recorded with them: a drill
    ranks: int | None = None  # a job bundle: its world size
    messages: int | None = None  # a job bundle: messages logged by all its ranks
    parts: list[dict] | None = None  # a job bundle: per rank its device, steps and messages
    layout: dict | None = None  # a job bundle: its mesh (bundle/layout.py; None: not recorded)
    job: str | None = None  # one rank's part: the job it belongs to
    rank: int | None = None  # one rank's part: its rank (``ranks``: the job's world size)
    coordinates: str | None = None  # one rank's part: where it lies in the job's mesh

    exit_code = 0

    @property
    def workload_named(self) -> str:
        """The workload as a person knows it: a script's recorded command, or a factory's
        reference with its keyword arguments."""
        ref = WorkloadRef._read(self.workload)
        if ref.is_script:
            return workload_named(ref)
        return f"{ref.ref} ({', '.join(f'{k}={v}' for k, v in ref.kwargs.items())})"

    JOB_ONLY = ("ranks", "messages", "parts", "layout")
    RANK_ONLY = ("job", "rank", "coordinates")

    def to_json(self) -> dict:
        body = {"schema": "sdcreplay.info/1", **vars(self)}
        left_out: tuple[str, ...] = self.JOB_ONLY if self.ranks is None else ()
        left_out += self.RANK_ONLY if self.rank is None else ("parts",)  # one part: no parts
        return {key: value for key, value in body.items() if key not in left_out}


def describe(path: str | Path, rank: int | None = None) -> BundleInfo:
    """What ``sdcreplay info`` shows: every file is verified first. A job bundle is described
    by its first part, with the job's completeness, ranks, messages and parts; one rank's part
    (``rank``, or ``JOB/ranks/00000R`` given as ``path``) with its job, its place in the mesh
    and its messages per step."""
    path = Path(path)
    if is_job_bundle(path):
        job = JobBundle.open(path, verify=rank is None)  # one rank: only its part is verified
        return _describe_job(job) if rank is None else _describe_rank(job, rank)
    if rank is not None:
        raise BundleError(
            f"--rank {rank} is for a job bundle (record --nproc); {path} is a single process's "
            "bundle",
            f"Leave it out: `sdcreplay info {path}`.",
            python_hint="Pass rank=None.",
        )
    bundle = Bundle.open(path, verify=True)
    job_path = job_of_part(bundle)
    if job_path is not None and bundle.manifest.distributed is not None:
        return _describe_rank(
            JobBundle.open(job_path, verify=False), bundle.manifest.distributed.rank, bundle
        )
    return _describe_bundle(bundle)


def _describe_rank(job: JobBundle, rank: int, part: Bundle | None = None) -> BundleInfo:
    """Rank ``rank``'s part (verified here: the job's other parts are not read), in its job."""
    if not 0 <= rank < job.world_size:
        raise BundleError(
            f"--rank {rank}: the job {job.path} has ranks 0..{job.world_size - 1}",
            f"Give one of them, e.g. `sdcreplay info {job.path} --rank 0`.",
            python_hint=f"Pass rank= one of 0..{job.world_size - 1}.",
        )
    part = part or Bundle.open(job.rank(rank).path, verify=True)
    messages = part.messages()
    info = _describe_bundle(part)
    for step in info.steps:
        step["messages"] = len(messages.get(step["index"], []))
    info.job, info.rank, info.ranks = str(job.path), rank, job.world_size
    info.messages = sum(map(len, messages.values()))
    info.layout = None if job.layout is None else job.layout.to_json()
    info.coordinates = None if job.layout is None else job.layout.describe(rank)
    info.trusted = job.trusted
    return info


def _describe_job(job: JobBundle) -> BundleInfo:
    parts: list[dict[str, Any]] = []
    messages = 0
    for entry in job.ranks:
        part = job.parts.get(entry.rank)
        logged = sum(map(len, part.messages().values())) if part is not None else 0
        messages += logged
        parts.append(
            {
                "rank": entry.rank,
                "device": entry.device,
                "steps": len(part.steps) if part is not None else 0,
                "messages": logged,
                "complete": part is not None and part.complete,
            }
        )
    if not job.parts:
        raise BundleError(f"the job {job.path} holds no rank part yet")
    info = _describe_bundle(job.parts[min(job.parts)])
    info.bundle, info.bundle_schema, info.complete = str(job.path), JOB_SCHEMA, job.complete
    info.ranks, info.messages, info.parts = job.world_size, messages, parts
    info.trusted = job.trusted
    info.layout = None if job.layout is None else job.layout.to_json()
    info.injected_faults = job.injected_faults
    return info


def _describe_bundle(bundle: Bundle) -> BundleInfo:
    manifest = bundle.manifest
    log = bundle.signature_log()
    return BundleInfo(
        bundle=str(bundle.path),
        bundle_schema=manifest.schema,
        complete=manifest.complete,
        created=manifest.created,
        workload=manifest.workload.to_json(),
        device=manifest.device,
        device_type=manifest.device_type,
        digest=manifest.digest,
        state=manifest.state.to_json(),
        steps=[
            {
                "index": step.index,
                "entries": step.entries,
                "optimizer_step": step.optimizer_step,
                "grads": step.grads,
            }
            for step in bundle.steps
        ],
        state_objects=bundle.state_object_names,
        verification=manifest.verification.to_json(),
        entries=log.entry_count(),
        files=len(manifest.files),
        size_bytes=bundle.size_bytes(),
        integrity="ok",
        environment=manifest.environment.to_json(),
        determinism=manifest.determinism.to_json(),
        fingerprint=manifest.fingerprint,
        must_match=must_match(manifest.fingerprint or {}, probed=bundle.has_probe),
        trusted=bundle.trusted,
        signature_level=manifest.capture.level,
        trigger=None if manifest.trigger is None else manifest.trigger.to_json(),
        probe=_probe_summary(bundle.probe()),
        compiled=manifest.compiled,
        injected_faults=bundle.injected_faults,
    )


def _probe_summary(probe: dict | None) -> dict | None:
    if probe is None:
        return None
    calls = probe.get("calls")
    return {"calls": len(calls) if isinstance(calls, list) else 0, "skipped": probe.get("skipped")}
