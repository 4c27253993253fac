"""Who a judged device is, in words that stay true across jobs, hosts and reboots.

A label (``cuda:3``) says where a device sat in one process; a fleet needs the board. On a
GPU the id is NVML's UUID (``GPU-...``, the board's own, whatever CUDA_VISIBLE_DEVICES
says), with its serial, PCI bus id and host beside it; on a CPU it is the label and the host
(``cpu@h17``, and for a virtual replica ``cpu:1@h17``, so the replicas of one host stay
apart), with the CPU model beside it. Torch is imported only to ask for a GPU's UUID, so
reading the ledger loads no torch.
"""

from __future__ import annotations

import functools
import platform
import re
import socket
from dataclasses import asdict, dataclass

from .nvml import nvml_identity

_GPU_LABEL = re.compile(r"^cuda(?::(\d+))?$")


@dataclass(frozen=True)
class DeviceIdentity:
    """A device as the ledger names it (``id``) and as a person finds it (the rest)."""

    id: str
    label: str
    host: str
    kind: str  # "cuda" or "cpu"
    model: str
    uuid: str | None = None
    serial: str | None = None
    pci_bus_id: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> DeviceIdentity:
        def text(name: str) -> str:
            return str(data.get(name) or "")

        return cls(
            text("id"),
            text("label"),
            text("host"),
            text("kind"),
            text("model"),
            data.get("uuid"),
            data.get("serial"),
            data.get("pci_bus_id"),
        )


def host_name() -> str:
    return socket.gethostname()


def cpu_model() -> str:
    """The CPU's model name as the kernel reports it (``/proc/cpuinfo``), else the platform's."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_identity(label: str, host: str, model: str) -> DeviceIdentity:
    return DeviceIdentity(f"{label}@{host}", label, host, "cpu", model)


def gpu_identity(label: str, host: str, model: str, uuid: str) -> DeviceIdentity:
    """A GPU by its UUID; NVML adds the serial and PCI bus id where it can (``gpu`` extra)."""
    uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
    board = nvml_identity(uuid, health=False).get("identity") or {}

    def known(key: str) -> str | None:
        value = board.get(key)
        return value if isinstance(value, str) and not value.startswith("unavailable") else None

    return DeviceIdentity(
        uuid, label, host, "cuda", model, uuid, known("serial"), known("pci_bus_id")
    )


@functools.lru_cache(maxsize=64)
def identify(label: str) -> DeviceIdentity:
    """The identity of the device ``label`` names on this host (cached per process).

    A GPU whose UUID cannot be read (no CUDA here) is named like a CPU, by label and host,
    so a record is never lost for want of a UUID.
    """
    host = host_name()
    if _GPU_LABEL.match(label):
        try:
            import torch

            from ..devices import torch_device

            device = torch_device(label)
            props = torch.cuda.get_device_properties(device.index or 0)
            uuid = str(getattr(props, "uuid", "") or "")
            if uuid:
                return gpu_identity(label, host, props.name, uuid)
        except Exception:  # no CUDA, no such GPU: named by label and host below
            pass
        return DeviceIdentity(f"{label}@{host}", label, host, "cuda", "unknown GPU")
    return cpu_identity(label, host, cpu_model())


def recorded_identity(label: str, host: str | None, device: dict | None) -> DeviceIdentity:
    """The identity of the device that recorded a bundle, from its environment (the manifest's
    ``device`` description), without touching any device."""
    device = device or {}
    host = host or "unknown-host"
    uuid = device.get("uuid")
    if device.get("type") == "cuda" and uuid:
        return gpu_identity(label, host, str(device.get("name") or "GPU"), str(uuid))
    return cpu_identity(label, host, str(device.get("name") or "unknown CPU"))
