"""What ``sdcreplay info`` shows of a bundle or a job: its facts, once every file is verified.

Like the reader, it imports no torch: reading a bundle's facts stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..capture.comparable import must_match
from ..errors import BundleError
from .job_bundle import JobBundle, is_job_bundle
from .manifest import JOB_SCHEMA
from .reader import Bundle


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

    exit_code = 0

    JOB_ONLY = ("ranks", "messages", "parts", "layout")

    def to_json(self) -> dict:
        body = {"schema": "sdcreplay.info/1", **vars(self)}
        if self.ranks is None:
            body = {key: value for key, value in body.items() if key not in self.JOB_ONLY}
        return body


def describe(path: str | Path) -> BundleInfo:
    """What ``sdcreplay info`` shows: every file is verified first. A job bundle is described
    by its first part, with the job's completeness, ranks, messages and parts."""
    if is_job_bundle(path):
        return _describe_job(JobBundle.open(path, verify=True))
    return _describe_bundle(Bundle.open(path, verify=True))


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
