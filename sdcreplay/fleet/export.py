"""The schedulers' language: what a person would run to take suspect devices out of service.

``sdcreplay devices export`` prints it and never runs it: a drain is a decision, and the
person who makes it reads the reason first. Slurm gets one ``scontrol update ...
State=DRAIN`` per node (its reason names every device on it), Kubernetes a taint per device
(and an annotation with the reason, which a taint cannot carry), other tools JSON, and
parsers of Megatron's tracker file its lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from ..ledger.tracker import tracker_line
from .devices import list_devices
from .states import STATES, DeviceState

SCHEMA = "sdcreplay.export/1"
ExportFormat = Literal["slurm", "kubernetes", "json", "tracker"]
DRAINED = ("suspect", "confirmed")
TAINT_PREFIX = "sdcreplay.io"


def _packet(op: str | None) -> str | None:
    """``aten.mm.default`` -> ``aten.mm``: what a person calls the operator."""
    if not op:
        return None
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else op


def reason(device: DeviceState) -> str:
    """``cuda:3 GPU-... suspect: aten.mm bit 22 rate 1``, from its latest finding."""
    finding = device.latest_finding
    words = [device.label, device.id, f"{device.state}:"]
    if finding is not None:
        words.append(finding.command)
        words += [w for w in (_packet(finding.operator),) if w]
        if finding.element is not None:
            words.append(f"element {finding.element}")
        if finding.bits:
            words.append(f"bit {finding.bits}")
        if finding.rate is not None:
            words.append(f"rate {finding.rate:.3g}")
    return " ".join(words).replace('"', "'")


def _short(host: str) -> str:
    """Slurm names nodes by their short host name (``hostname -s``)."""
    return host.split(".")[0]


def _taint_key(label: str) -> str:
    return f"{TAINT_PREFIX}/sdc-" + re.sub(r"[^A-Za-z0-9_.-]", "-", label)[:50]


@dataclass
class Export:
    format: ExportFormat
    ledger: str
    devices: list[DeviceState]
    lines: list[str] = field(default_factory=list)  # what --format slurm/kubernetes/tracker print

    exit_code = 0

    def nodes(self) -> dict[str, list[DeviceState]]:
        grouped: dict[str, list[DeviceState]] = {}
        for device in self.devices:
            grouped.setdefault(device.host, []).append(device)
        return grouped

    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "ledger": self.ledger,
            "nodes": [
                {
                    "host": host,
                    "slurm": slurm_line(host, devices),
                    "kubernetes": kubernetes_lines(host, devices),
                    "devices": [
                        {**device.to_json(), "drain_reason": reason(device)} for device in devices
                    ],
                }
                for host, devices in self.nodes().items()
            ],
        }


def slurm_line(host: str, devices: list[DeviceState]) -> str:
    reasons = "; ".join(reason(device) for device in devices)
    return f'scontrol update NodeName={_short(host)} State=DRAIN Reason="sdcreplay: {reasons}"'


def kubernetes_lines(host: str, devices: list[DeviceState]) -> list[str]:
    lines = []
    for device in devices:
        key = _taint_key(device.label)
        lines.append(f"kubectl taint nodes {host} {key}={device.state}:NoSchedule --overwrite")
        lines.append(
            f'kubectl annotate node {host} {key}="sdcreplay: {reason(device)}" --overwrite'
        )
    return lines


def export(
    format: ExportFormat, location: str | None = None, states: tuple[str, ...] | None = None
) -> Export:
    """The lines (or JSON) that take the devices in ``states`` (default: suspect and
    confirmed; for ``tracker``, every device) out of service."""
    listing = list_devices(location)
    chosen_states = states or (STATES if format == "tracker" else DRAINED)
    chosen = [device for device in listing.devices if device.state in chosen_states]
    exported = Export(format, listing.ledger, chosen)
    if format == "slurm":
        exported.lines = [slurm_line(host, devices) for host, devices in exported.nodes().items()]
    elif format == "kubernetes":
        exported.lines = [
            line
            for host, devices in exported.nodes().items()
            for line in kubernetes_lines(host, devices)
        ]
    elif format == "tracker":
        exported.lines = [tracker_line(r) for device in chosen for r in device.records]
    return exported
