"""Replay over replicas: the same bundle on several device labels at once, and the vote.

Each label replays in its own device process (`session.run_replay_task`);
what they wrote is read back, judged against the record by `compare.logs.vote`,
and reported with the caveats a reader needs before blaming a device. What
would fail on every device is refused once, before any process starts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.checkpoints import verify_checkpoint
from ..bundle.manifest import CheckpointState
from ..bundle.reader import Bundle, ignored_environment
from ..capture import comparable
from ..capture.compiled import CompiledRegion
from ..capture.fault_spec import parse_specs
from ..capture.signature import SignatureLog, read_signature_log
from ..compare.compiled_code import code_differences, entry_region
from ..compare.logs import RECORD, Consensus, DeviceVerdict, vote
from ..devices import validate_label
from ..errors import BundleError, DeviceError, FaultSpecError, SdcReplayError
from ..kinds import DeviceRunVerdict, DeviceVerdictName
from ..ledger.identity import DeviceIdentity, identify, recorded_identity
from ..ledger.notes import note_result
from ..ledger.verdicts import incident_of
from ..storage.rundir import claim, make_run_dir
from .processes import (
    STARTUP_SECONDS,
    STEP_FACTOR,
    UNKNOWN_STEP_TIMEOUT,
    process_context,
    run_device_processes,
)
from .worker import DeviceResult

REPLAY_TASK = "sdcreplay.replay.session:run_replay_task"
"""Named, not imported: the session imports torch, which only the device processes need."""


@dataclass
class DeviceRun:
    """What one device process produced: its logs, or why it died."""

    device: str
    logs: list[SignatureLog] = field(default_factory=list)
    log_paths: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    error: dict | None = None
    injected: list[list[dict]] = field(default_factory=list)  # faults that fired, per repeat
    judgement: DeviceVerdict | None = None
    fingerprint: dict | None = None  # the process's own, after its run
    differences: list[str] = field(
        default_factory=list
    )  # result-affecting properties unlike the record's
    spread_from: int | None = None  # in a job: the origin rank whose corruption reached it
    probe: dict | None = None  # the bundle's kernel probe run here (ProbeOutcome.to_json)
    compiled: list[CompiledRegion] = field(default_factory=list)  # the code generated here
    identity: dict | None = None  # the device's, as its own node saw it (else this host's)

    @property
    def verdict(self) -> DeviceRunVerdict:
        if self.error is not None:
            return "error"
        if self.spread_from is not None:
            return "spread"
        return self.judgement.verdict if self.judgement else "match"

    @property
    def divergence_region(self) -> str | None:
        """Where a compiled step computed the first divergence: the region, its graph
        (forward or backward) and the modules it covers; None outside compiled code."""
        first = self.judgement.first_divergence if self.judgement else None
        return None if first is None else entry_region(first.name, self.compiled)

    def to_json(self) -> dict:
        judgement = self.judgement
        first = judgement.first_divergence if judgement else None
        identity = (
            DeviceIdentity.from_json(self.identity) if self.identity else identify(self.device)
        )
        return {
            "device": self.device,
            "device_id": identity.id,
            "identity": identity.to_json(),
            "verdict": self.verdict,
            "repeats": judgement.runs if judgement else 0,
            "divergent_repeats": judgement.divergent_runs if judgement else 0,
            "first_divergence": None if first is None else first.brief(),
            "first_divergence_in": self.divergence_region,
            "steps": {str(step): count for step, count in judgement.per_step.items()}
            if judgement
            else {},
            "logs": self.log_paths,
            "warnings": self.warnings,
            "injected": self.injected,
            "error": self.error,
            "fingerprint": self.fingerprint,
            "fingerprint_differences": self.differences,
            "probe": self.probe,
            **({} if self.spread_from is None else {"spread_from": self.spread_from}),
        }


UNVERIFIED_CAVEAT = (
    "the recording was not verified (recorded with verify off, before verification existed, or it "
    "failed): a difference between the record and every replay may be the training loop doing "
    "something the workload's step does not, not the recording device"
)


def probe_differences(probe: dict | None) -> list[str]:
    """Why a replica whose kernel probe gave other bits may not vote on the record: the first
    kernels that differ, and which outcome it had (replicas with the same outcome compute
    alike and may judge each other)."""
    if probe is None or probe["matched"]:
        return []
    outcome = hashlib.sha256(json.dumps(probe["digests"]).encode()).hexdigest()[:12]
    shown = list(
        dict.fromkeys(  # one line a kernel: calls that differ only in strides read alike
            f"probe: {call['kernel']} "
            + (f"raises here ({call['error']})" if "error" in call else "gives other bits here")
            for call in probe["differing"]
        )
    )[:3]
    return [
        *shown,
        f"probe: {probe['differing_count']} of {probe['ran']} kernels differ from the "
        f"recording's (outcome {outcome}): another CPU or GPU model or library build than the "
        "recording's, or a defect of the recording device on those kernels; a replica on the "
        "recording's kind of machine would decide",
    ]


def judge_comparability(run: DeviceRun, bundle: Bundle, value: dict) -> None:
    """What keeps a finished replica from voting on ``bundle``'s record: its fingerprint's
    result-affecting properties, then the code it generated for the compiled regions, then
    its kernel probe (``value``: its device task's result)."""
    run.compiled = [CompiledRegion.from_json(region) for region in value.get("compiled", [])]
    run.differences = (
        comparable.fingerprint_differences(
            bundle.manifest.fingerprint, run.fingerprint, probed=bundle.has_probe
        )
        or code_differences(bundle.compiled_regions, run.compiled)
        or probe_differences(run.probe)
    )


def case_gaps(bundle: Bundle) -> list[str]:
    """What a replay of this bundle can never supply to accuse its recording device."""
    gaps = []
    if not bundle.verified:
        gaps.append(
            "the recording is unverified: a difference between record and replays may be the "
            "program, not the device"
            + (
                f" (the check found: {bundle.verification.problem})"
                if bundle.verification.problem
                else ""
            )
        )
    if not bundle.has_probe:
        gaps.append(
            "the bundle holds no kernel probe (written before probes existed, or with "
            "verification off): nothing shows that the replicas compute like the recording "
            "device"
        )
    return gaps


def incomparable_failure(
    bundle: str, incomparable: dict[str, list[str]], probed: str | None = None
) -> SdcReplayError:
    """No verdict (exit 3): no replica ran on a machine that computes like the recording's, so
    nothing it computed is evidence either way. ``incomparable``: what differs, per replica;
    ``probed``: the bundle ``doctor --against`` takes (a job's: one rank's part)."""
    differences = "; ".join(f"{label}: {diffs[0]}" for label, diffs in incomparable.items())
    return SdcReplayError(
        f"no verdict: no replica ran on a machine comparable with the recording's ({differences})",
        "Replay on the recording's kind of machine (its CPU or GPU model and software: "
        f"`sdcreplay info {bundle}`); `sdcreplay doctor --against {probed or bundle}` on a "
        "machine says whether it can judge this bundle.",
    )


def caveat_for(bundle: Bundle) -> str | None:
    """What a reader of a replay of this bundle must know before blaming the recording device."""
    if bundle.verified:
        return None
    problem = bundle.verification.problem
    return UNVERIFIED_CAVEAT + (f" (the check found: {problem})" if problem else "")


@dataclass
class ReplayReport:
    bundle: str
    repeats: int
    log_dir: str
    devices: list[DeviceRun]
    consensus: Consensus | None
    caveat: str | None = None
    injected_specs: list[str] = field(default_factory=list)  # the --inject specs asked for
    record_identity: dict | None = None  # the recording device's (ledger.identity)
    incident: str | None = None  # the bundle's identity (ledger.verdicts.incident_of)
    recorded_faults: list[str] = field(default_factory=list)  # a drill bundle's (its manifest)
    # The shell's variables no device process took that could change the result (script.py).
    ignored_environment: list[str] = field(default_factory=list)

    @property
    def injection_missed(self) -> bool:
        """Faults were asked for and none fired on any device: the spec selects nothing."""
        return bool(self.injected_specs) and not any(
            fired for run in self.devices for fired in run.injected
        )

    @property
    def record_verdict(self) -> DeviceVerdictName:
        judgement = self.consensus.voters.get(RECORD) if self.consensus else None
        return judgement.verdict if judgement else "match"

    @property
    def failed(self) -> list[DeviceRun]:
        """Devices that died or timed out: the verdict is computed without them."""
        return [run for run in self.devices if run.error is not None]

    @property
    def exit_code(self) -> int:
        if self.consensus is not None and self.consensus.verdict == "incomparable":
            return 3  # no comparable machine replayed: no evidence either way
        if self.consensus is not None and self.consensus.verdict != "correct":
            return 1
        return 3 if self.failed else 0

    def failure(self) -> SdcReplayError | None:
        """Why the replay could not give a full answer (exit 3), or None."""
        if self.exit_code != 3:
            return None
        if self.consensus is not None and self.consensus.verdict == "incomparable":
            return incomparable_failure(self.bundle, self.consensus.incomparable)
        if not self.failed:
            return None
        failed = [(run.device, run.error) for run in self.devices if run.error is not None]
        names = "; ".join(f"{device}: {error['message']}" for device, error in failed)
        logs = ", ".join(error["log"] for _, error in failed if error.get("log"))
        where = f" (logs: {logs})" if logs else ""
        if self.consensus is None:
            return SdcReplayError(
                f"no verdict: no device finished ({names})",
                f"Fix what stopped the devices and replay again{where}.",
            )
        return SdcReplayError(
            f"{len(self.failed)} of {len(self.devices)} devices did not finish ({names}); "
            "the verdict covers only the others",
            f"Replay those devices again to include them{where}.",
        )

    def to_json(self) -> dict:
        return {
            "schema": "sdcreplay.replay/1",
            "bundle": self.bundle,
            "incident": self.incident,
            "inject": self.injected_specs,
            "recorded_faults": self.recorded_faults,
            "repeats": self.repeats,
            "log_dir": self.log_dir,
            "verdict": self.consensus.verdict if self.consensus else "error",  # as a job's
            "record": {"verdict": self.record_verdict, "identity": self.record_identity},
            "devices": [run.to_json() for run in self.devices],
            "consensus": self.consensus.to_json() if self.consensus else None,
            "verified": self.caveat is None,
            "caveat": self.caveat,
            "finished": len(self.devices) - len(self.failed),
            "failed": [run.device for run in self.failed],
            "ignored_environment": self.ignored_environment,
        }


def progress_timeout(bundle: Bundle) -> float:
    """Seconds a device process may go without progress, derived from the recorded step times.

    Generous on purpose (a replica may share cores with others, or run on a
    slower device): it exists to end a hang, not to judge speed.
    """
    times = [step.seconds for step in bundle.steps if step.seconds is not None]
    if not times or len(times) < len(bundle.steps):
        return UNKNOWN_STEP_TIMEOUT
    return round(STARTUP_SECONDS + STEP_FACTOR * max(times), 1)


def refuse_unmatched_specs(
    values: Sequence[tuple[str, int | None, dict | None]], bundle: str | Path = "BUNDLE"
) -> None:
    """A fault spec that selected no call in any process it applies to is a mistake in the
    spec, not a finding. ``values``: (device label, rank or None, the task's value or None when
    it failed) of every process; with a failed one nothing can be concluded. ``bundle``: the
    replayed bundle, which the hint's ``ops`` command lists."""
    finished = [(label, rank, value) for label, rank, value in values if value is not None]
    if not values or len(finished) < len(values) or any("unmatched" not in v for *_, v in finished):
        return
    by_spec: dict[str, list[str]] = {}
    for *_, value in finished:
        for miss in value["unmatched"]:
            by_spec.setdefault(miss["spec"], miss["closest"])
    for spec, closest in by_spec.items():
        (parsed,) = parse_specs([spec], False)
        applies = [
            (label, rank, value)
            for label, rank, value in finished
            if parsed.applies_to(label, rank)
        ]
        missed = [
            entry for entry in applies if any(m["spec"] == spec for m in entry[2]["unmatched"])
        ]
        if applies and len(missed) == len(applies):
            raise FaultSpecError(
                f"fault spec {spec!r} matches no operator call of the replayed steps",
                "Closest calls: "
                + "; ".join(closest)
                + f". `{ops_command(bundle, parsed.step, missed[0][1])}` lists them all.",
            )


def ops_command(bundle: str | Path, step: int | None, rank: int | None = None) -> str:
    """The ``sdcreplay ops`` command that lists a step's calls of ``bundle`` (a job's: rank
    ``rank``'s), as a hint names it."""
    on_rank = "" if rank is None else f" --rank {rank}"
    return f"sdcreplay ops {bundle}{on_rank} --step {'N' if step is None else step}"


def default_log_dir(bundle_path: Path) -> Path:
    """``BUNDLE.replay/<time>-<pid>-<random>/``, created now and this run's alone."""
    return make_run_dir(bundle_path.with_name(bundle_path.name + ".replay"))


def replay_devices(
    bundle: str | Path,
    devices: list[str],
    *,
    repeats: int = 1,
    inject: Sequence[str] = (),
    last_step: int | None = None,
    log_dir: str | Path | None = None,
    on_done: Callable[[str, DeviceResult], None] | None = None,
    timeout: float | None = None,
    ledger: bool = True,
) -> ReplayReport:
    """Replay on every device label at once, each in its own process, and vote.

    A workload that is neither built in nor recorded here runs only inside
    ``trust.granting([ref])`` (what ``--trust-workload`` does), see `bundle.trust`.
    ``timeout``: seconds a device may go without finishing a step before it is
    killed (default: derived from the recorded step times, see `progress_timeout`).
    ``ledger``: append each judged device's verdict to the device ledger (docs/fleet.md).
    """
    process_context(REPLAY_TASK.partition(":")[0])  # it imports torch while the bundle is read
    opened = Bundle.open(bundle)
    labels = [validate_label(label) for label in devices]
    # What would fail on every device is refused here, once, before any process starts.
    if not opened.steps:
        raise BundleError(
            f"{opened.path} holds no steps (the recording ended before its first step finished)",
            "There is nothing to replay: record again, and let at least one step complete.",
        )
    opened.require_trusted()
    parse_specs(inject)
    comparable.check_environment(opened.manifest.determinism.to_json())
    if isinstance(opened.manifest.state, CheckpointState):
        verify_checkpoint(opened.manifest.state)
    if len(set(labels)) != len(labels):
        raise DeviceError(
            f"device labels repeat: {labels}", "Give each replica its own label: cpu:0, cpu:1, ..."
        )
    log_dir = claim(log_dir) if log_dir else default_log_dir(opened.path)
    recorded_fingerprint = opened.manifest.fingerprint
    results = run_device_processes(
        "replay",
        REPLAY_TASK,
        labels,
        lambda label: {
            "bundle": opened.path,
            "repeats": repeats,
            "inject": list(inject),
            "last_step": last_step,
            "log_dir": log_dir,
        },
        log_dir,
        environment=comparable.pinned_environment(recorded_fingerprint),
        on_done=on_done,
        timeout=progress_timeout(opened) if timeout is None else timeout,
    )
    errors = [result.error for result in results.values() if result.error is not None]
    wrong_spec = next((error for error in errors if error.kind == FaultSpecError.__name__), None)
    if wrong_spec is not None:  # the spec's mistake, not a device's: no verdict from the others
        raise FaultSpecError(wrong_spec.message, wrong_spec.hint)
    if len(errors) == len(results) and len({error.message for error in errors}) == 1:
        shared = errors[0]  # the same failure everywhere: the tool's, not a device's
        raise SdcReplayError(f"every device failed: {shared.said()}", shared.hint)
    refuse_unmatched_specs(
        [(label, None, result.value) for label, result in results.items()], opened.path
    )
    runs = []
    for label in labels:
        error, value = results[label].error, results[label].value or {}
        run = DeviceRun(
            label,
            error=error.to_json() if error else None,
            warnings=value.get("warnings", []),
            injected=value.get("injected", []),
            fingerprint=value.get("fingerprint"),
            probe=value.get("probe"),
        )
        if run.error is None:
            run.log_paths = value["logs"]
            run.logs = [read_signature_log(Path(path)) for path in run.log_paths]
            judge_comparability(run, opened, value)
        runs.append(run)
    record = opened.signature_log()
    if last_step is not None:
        record.steps = {s: e for s, e in record.steps.items() if s <= last_step}
    healthy = {run.device: run.logs for run in runs if run.error is None}
    incomparable = {run.device: run.differences for run in runs if run.differences}
    consensus = vote(record, healthy, incomparable, case_gaps(opened)) if healthy else None
    for run in runs:
        if consensus is not None and run.device in consensus.voters:
            run.judgement = consensus.voters[run.device]
    report = ReplayReport(
        str(opened.path),
        repeats,
        str(log_dir),
        runs,
        consensus,
        caveat_for(opened),
        injected_specs=list(inject),
        record_identity=recorded_identity(
            opened.manifest.device,
            opened.manifest.environment.host,
            opened.manifest.environment.device,
        ).to_json(),
        incident=incident_of(opened.manifest.manifest_sha256),
        recorded_faults=opened.injected_faults,
        ignored_environment=ignored_environment(opened.manifest.workload),
    )
    if ledger:
        note_result(report.to_json())
    return report
