"""The schedulers' language: what a person would run to take suspect devices out of service.

``sdcreplay devices export`` prints it and never runs it: a drain is a decision, and the
person who makes it reads the reason first. Slurm gets one ``scontrol update ...
State=DRAIN`` per node (its reason names every device on it), Kubernetes a taint per device
(and an annotation with the reason, which a taint cannot carry), other tools JSON, and
parsers of Megatron's tracker file its lines.

The lines are data, never code, whatever the ledger holds (a host name, an operator, a
clearing's reason come from other people's files and machines): a node name reaches a line
only when it is a valid name for that scheduler (Slurm: an RFC 1123 label, the short host
name; Kubernetes: an RFC 1123 subdomain), else the node is refused in a comment; every
free text is made one line (`one_line`) and quoted for the shell (``shlex.quote``). A
device whose only findings are drills (injected faults) is in the ``drill`` state, which no
line drains: asked for, it is printed commented out.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Literal

from ..ledger.tracker import one_line, tracker_line
from .devices import list_devices
from .states import DRILL, STATES, DeviceState

SCHEMA = "sdcreplay.export/1"
ExportFormat = Literal["slurm", "kubernetes", "json", "tracker"]
DRAINED = ("suspect", "confirmed")
TAINT_PREFIX = "sdcreplay.io"
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
SLURM_NODE = re.compile(_LABEL)
_K8S_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
KUBERNETES_NODE = re.compile(rf"(?=.{{1,253}}\Z){_K8S_LABEL}(?:\.{_K8S_LABEL})*")
RULES = {
    "slurm": "an RFC 1123 label: letters, digits and '-', at most 63",
    "kubernetes": "an RFC 1123 subdomain: lower-case letters, digits, '-' and '.', at most 253",
}


def _packet(op: str | None) -> str | None:
    """``aten.mm.default`` -> ``aten.mm``: what a person calls the operator."""
    if not op:
        return None
    parts = op.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else op


def reason(device: DeviceState) -> str:
    """``cuda:3 GPU-... suspect: aten.mm bit 22 rate 1``, from its latest finding (a drill's:
    its latest drill finding): one line."""
    finding = device.latest_finding or (device.drills[-1] if device.drills else None)
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
    return one_line(" ".join(words))


def slurm_node(host: str) -> str:
    """Slurm names nodes by their short host name (``hostname -s``)."""
    return host.split(".")[0]


def node_name(scheduler: str, host: str) -> str | None:
    """The node's name for ``scheduler`` when ``host`` gives a valid one, else None."""
    if scheduler == "slurm":
        name = slurm_node(host)
        return name if SLURM_NODE.fullmatch(name) else None
    return host if KUBERNETES_NODE.fullmatch(host) else None


def refusal(scheduler: str, host: str, devices: list[DeviceState]) -> str:
    """The comment printed instead of the lines of a node whose name is not valid."""
    names = ", ".join(f"{d.label} {d.id}" for d in devices)
    return one_line(
        f"# sdcreplay: not exported: the host {host!r} ({names}) is not a valid {scheduler} "
        f"node name ({RULES[scheduler]}); drain it by hand after checking its name"
    )


def _taint_key(label: str) -> str:
    name = ("sdc-" + re.sub(r"[^A-Za-z0-9_.-]", "-", label))[:63].rstrip("-_.")
    return f"{TAINT_PREFIX}/{name}"


def slurm_line(host: str, devices: list[DeviceState]) -> str:
    node = node_name("slurm", host)
    if node is None:
        return refusal("slurm", host, devices)
    reasons = "; ".join(reason(device) for device in devices)
    return f"scontrol update NodeName={node} State=DRAIN Reason=" + shlex.quote(
        f"sdcreplay: {reasons}"
    )


def kubernetes_lines(host: str, devices: list[DeviceState]) -> list[str]:
    node = node_name("kubernetes", host)
    if node is None:
        return [refusal("kubernetes", host, devices)]
    lines = []
    for device in devices:
        key = _taint_key(device.label)
        lines.append(f"kubectl taint nodes {node} {key}={device.state}:NoSchedule --overwrite")
        annotation = shlex.quote(f"sdcreplay: {reason(device)}")
        lines.append(f"kubectl annotate node {node} {key}={annotation} --overwrite")
    return lines


def _as_drill(lines: list[str]) -> list[str]:
    """A drill's lines, commented out: what the drain would have been, never a drain."""
    return [
        line if line.startswith("#") else "# drill (injected faults, not evidence): " + line
        for line in lines
    ]


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

    def groups(self) -> list[tuple[str, list[DeviceState], bool]]:
        """(host, devices, drill) per node: a node's drill devices apart from the others."""
        return [
            (host, chosen, drill)
            for host, devices in self.nodes().items()
            for drill in (False, True)
            if (chosen := [d for d in devices if (d.state == DRILL) == drill])
        ]

    def refused(self) -> list[str]:
        """The hosts whose lines were refused for the format (their names are not valid)."""
        scheduler = self.format if self.format in RULES else None
        if scheduler is None:
            return []
        return [host for host in self.nodes() if node_name(scheduler, host) is None]

    def to_json(self) -> dict:
        nodes = []
        for host, devices, drill in self.groups():
            slurm = [slurm_line(host, devices)]
            kubernetes = kubernetes_lines(host, devices)
            nodes.append(
                {
                    "host": host,
                    "drill": drill,
                    "slurm": (_as_drill(slurm) if drill else slurm)[0],
                    "kubernetes": _as_drill(kubernetes) if drill else kubernetes,
                    "refused": [s for s in RULES if node_name(s, host) is None],
                    "devices": [
                        {**device.to_json(), "drain_reason": reason(device)} for device in devices
                    ],
                }
            )
        return {"schema": SCHEMA, "ledger": self.ledger, "nodes": nodes}


def export(
    format: ExportFormat, location: str | None = None, states: tuple[str, ...] | None = None
) -> Export:
    """The lines (or JSON) that take the devices in ``states`` (default: suspect and
    confirmed; for ``tracker``, every device) out of service; drills commented out."""
    listing = list_devices(location)
    chosen_states = states or (STATES if format == "tracker" else DRAINED)
    chosen = [device for device in listing.devices if device.state in chosen_states]
    exported = Export(format, listing.ledger, chosen)
    if format in ("slurm", "kubernetes"):
        for host, devices, drill in exported.groups():
            lines = (
                [slurm_line(host, devices)]
                if format == "slurm"
                else kubernetes_lines(host, devices)
            )
            exported.lines += _as_drill(lines) if drill else lines
    elif format == "tracker":
        exported.lines = [tracker_line(r) for device in chosen for r in device.records]
    return exported
