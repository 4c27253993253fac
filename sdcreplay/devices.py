"""Device labels: ``cpu``, ``cuda:N``, and virtual CPU replicas ``cpu:N``.

A label names a replica, a torch device runs it: ``cpu:1`` and ``cpu:2`` are
two processes on the same CPU, which is how a defective GPU among healthy ones
is modelled (a fault spec can target one label) on a machine without GPUs.
"""

from __future__ import annotations

import re

import torch

from .errors import DeviceError

_LABEL = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def torch_device(label: str) -> torch.device:
    """The torch device a label runs on; refuses labels this machine cannot run."""
    match = _LABEL.match(label.strip())
    if not match:
        raise DeviceError(f"unknown device label {label!r}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {label} was asked for but this machine has no CUDA device",
            "Use cpu or virtual replicas cpu:0, cpu:1, ... on a machine without GPUs.",
        )
    index = int(index or 0)
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device {label} does not exist (this machine has {torch.cuda.device_count()} GPUs)"
        )
    return torch.device("cuda", index)


def validate_label(label: str) -> str:
    """Check the label's syntax without touching CUDA (the worker checks the rest)."""
    if not _LABEL.match(label.strip()):
        raise DeviceError(f"unknown device label {label!r}")
    return label.strip()
