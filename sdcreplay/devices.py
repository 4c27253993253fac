"""Device labels: ``cpu``, ``cuda:N``, and virtual CPU replicas ``cpu:N``.

A label names a replica, a torch device runs it: ``cpu:1`` and ``cpu:2`` are
two processes on the same CPU, which is how a defective GPU among healthy ones
is modelled (a fault spec can target one label) on a machine without GPUs.
A label this machine cannot run is refused before any device process starts
(`require_available`), without importing torch where torch is not loaded yet.
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import DeviceError

if TYPE_CHECKING:
    import torch

_LABEL = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
NO_CUDA_HINT = "Use cpu or virtual replicas cpu:0, cpu:1, ... on a machine without GPUs."


def torch_device(label: str) -> torch.device:
    """The torch device a label runs on; refuses labels this machine cannot run."""
    import torch

    match = _LABEL.match(label.strip())
    if not match:
        raise DeviceError(f"unknown device label {label!r}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(
            f"device {label} was asked for but this machine has no CUDA device", NO_CUDA_HINT
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


def require_available(label: str) -> str:
    """`validate_label`, and refused when this machine cannot have the device: what a person
    asks for is checked before any device process starts.

    For ``cuda:N``: refused when no CUDA device can exist here (`cuda_absent`: read from
    torch's build and the driver's files, torch not imported) and, where torch is loaded
    already, when N is not below its GPU count (which creates no CUDA context).
    """
    label = validate_label(label)
    match = _LABEL.match(label)
    if match is None or match.group(1) != "cuda":
        return label
    absent = cuda_absent()
    if absent:
        raise DeviceError(
            f"device {label} was asked for but this machine has no CUDA device ({absent})",
            NO_CUDA_HINT,
        )
    torch = sys.modules.get("torch")
    count = torch.cuda.device_count() if torch is not None else None
    if count is not None and int(match.group(2) or 0) >= count:
        raise DeviceError(f"device {label} does not exist (this machine has {count} GPUs)")
    return label


def cuda_absent(root: Path = Path("/")) -> str | None:
    """Why no CUDA device can exist here, or None when one may (then only torch can tell).

    Certain answers only: torch built without CUDA or ROCm, ``CUDA_VISIBLE_DEVICES`` empty,
    or (Linux, a CUDA build) no NVIDIA driver loaded. ``root``: where ``/dev`` and ``/proc``
    are.
    """
    build = torch_build()
    if build is not None and build.get("cuda") is None and build.get("hip") is None:
        return f"torch {build.get('__version__') or '(version unknown)'} is built without CUDA"
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU"
    hip = build is not None and build.get("hip") is not None
    if sys.platform == "linux" and not hip and not _nvidia_driver(root):
        return "no NVIDIA driver is loaded: no /proc/driver/nvidia, no /dev/nvidia*"
    return None


def _nvidia_driver(root: Path) -> bool:
    """Does this machine show an NVIDIA driver (WSL's /dev/dxg counts: CUDA runs through it)?"""
    if (root / "proc/driver/nvidia").exists() or (root / "dev/dxg").exists():
        return True
    return bool(glob.glob(str(root / "dev/nvidia*")))


def torch_build() -> dict[str, str | None] | None:
    """``torch.version``'s ``__version__``, ``cuda`` and ``hip``, read from its source without
    importing torch (None when that file cannot be read: then nothing is concluded)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        version = torch.version
        return {"__version__": torch.__version__, "cuda": version.cuda, "hip": version.hip}
    try:
        spec = importlib.util.find_spec("torch")
        origin = spec.origin if spec is not None else None
        if origin is None:
            return None
        tree = ast.parse((Path(origin).parent / "version.py").read_text())
    except (OSError, ValueError, SyntaxError, ImportError):
        return None
    found: dict[str, str | None] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found[target.id] = value.value if isinstance(value.value, str) else None
    return found if "cuda" in found else None
