"""Can this machine judge a bundle? The recording's kernel probe, run here before any replay.

A replica votes on a record only if it computes the step's kernels as the
recording device did (docs/trust-and-comparability.md). ``sdcreplay doctor
--against BUNDLE`` asks that of a machine without replaying anything: the
probe runs in a device process with the recording's kernel choices pinned,
as a replay's would, and the answer names the kernels that give other bits.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ..bundle.reader import Bundle
from ..capture import comparable, determinism
from ..capture.faults import other_machine_kernels
from ..devices import torch_device, validate_label
from ..errors import BundleError, SdcReplayError
from .processes import run_device_processes
from .replicas import probe_differences
from .session import run_recorded_probe
from .worker import device_task

SCHEMA = "sdcreplay.doctor/1"


@dataclass
class ComparabilityReport:
    """Whether ``device`` here computes like the device that recorded ``bundle``."""

    bundle: str
    device: str
    fingerprint_differences: list[str]
    probe: dict
    fingerprint: dict = field(default_factory=dict)

    @property
    def comparable(self) -> bool:
        return not self.fingerprint_differences and self.probe["matched"]

    @property
    def exit_code(self) -> int:
        """A machine that cannot judge the bundle is a finding (1), as a divergence is."""
        return 0 if self.comparable else 1

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "against": self.bundle,
            "device": self.device,
            "comparable": self.comparable,
            "fingerprint_differences": self.fingerprint_differences,
            "probe": self.probe,
            "fingerprint": self.fingerprint,
        }


@device_task
def run_probe_task(device: str, bundle: str) -> dict:
    """In a device process: the bundle's probe here, and this process's fingerprint."""
    opened = Bundle.open(bundle)
    with other_machine_kernels():
        probe = run_recorded_probe(opened, device)
    return {"probe": probe, "fingerprint": determinism.fingerprint(torch_device(device))}


def judge_against(bundle: str | Path, device: str = "cpu") -> ComparabilityReport:
    """Run ``bundle``'s kernel probe on ``device`` (in its own process, kernels pinned)."""
    validate_label(device)
    opened = Bundle.open(bundle)
    if not opened.has_probe:
        raise BundleError(
            f"{opened.path} holds no kernel probe (written before probes existed, or with "
            "verification off): nothing here can show whether a machine computes like its "
            "recording device",
            "Record the bundle again with this version of sdcreplay (verification on), or "
            "replay it on a machine of the recording's kind (`sdcreplay info` names it).",
        )
    recorded = opened.manifest.fingerprint
    with tempfile.TemporaryDirectory(prefix="sdcreplay-doctor-") as work:
        results = run_device_processes(
            "probe",
            run_probe_task,
            [device],
            lambda label: {"bundle": opened.path},
            Path(work),
            environment=comparable.pinned_environment(recorded),
        )
    result = results[device]
    if result.error is not None:
        raise SdcReplayError(
            f"the probe did not run on {device}: {result.error.message}",
            result.error.hint or "See the device process's log: " + str(result.error.log),
        )
    value = result.value or {}
    return ComparabilityReport(
        str(opened.path),
        device,
        comparable.fingerprint_differences(recorded, value["fingerprint"]),
        value["probe"],
        value["fingerprint"],
    )


def probe_in_processes(bundle: Bundle, labels: list[str], work: Path) -> dict[str, list[str]]:
    """Per label, how it is unlike the recording device (fingerprint, then probe); [] alike."""
    results = run_device_processes(
        "probe",
        run_probe_task,
        labels,
        lambda label: {"bundle": bundle.path},
        work,
        environment=comparable.pinned_environment(bundle.manifest.fingerprint),
    )
    unlike = {}
    for label, result in results.items():
        if result.error is not None:
            raise SdcReplayError(
                f"the kernel probe did not run on {label}: {result.error.message}",
                result.error.hint or f"See the device process's log: {result.error.log}",
            )
        value = result.value or {}
        unlike[label] = comparable.fingerprint_differences(
            bundle.manifest.fingerprint, value["fingerprint"], probed=bundle.has_probe
        ) or probe_differences(value["probe"])
    return unlike


def refuse_unlike_reference(
    unlike: dict[str, list[str]], reference: str, suspect: str | None
) -> None:
    """A reference must compute like the device it judges: the recording device (no suspect) or
    the suspect. A kernel that computes differently on another kind of machine would read as an
    ``isolated: kernel`` finding."""
    judged = "the recording device" if suspect is None else suspect
    theirs = [] if suspect is None else unlike.get(suspect, [])
    if unlike.get(reference, []) == theirs:
        return
    why = "; ".join(unlike.get(reference) or theirs)
    raise SdcReplayError(
        f"the reference {reference} does not compute like {judged}: {why}",
        "Use a reference of the same kind of machine as the device judged "
        "(`sdcreplay doctor --against BUNDLE --device D` says which devices compute like its "
        "recording); another model's kernels differ without any defect.",
    )
