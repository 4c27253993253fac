"""Which fingerprint properties a replay must share with the record, the environment that
puts the recorded kernel choices in force and the switch variables it refuses: no torch needed.

Split from determinism.py so that ``sdcreplay info`` names them, and a command's process
prepares its device processes, without importing torch.
"""

from __future__ import annotations

import os

from ..errors import DeterminismError
from .environment import PINNED_ENV

# Compared between the record and a replica. The CPU model is compared only
# when MKL chose its kernels by CPU (no MKL_CBWR branch): MKL dispatches per
# CPU model, while ATen's kernels follow the capability alone.
RESULT_AFFECTING = (
    "torch.version",
    "torch.git",
    "cpu.capability",
    "cpu.blas_branch",
    "mkl",
    "onednn",
    "threads.intra_op",
    "gpu.name",
    "gpu.capability",
    "gpu.sm_count",
    "gpu.mig",
    "driver",
    "cuda.runtime",
    "cublas",
    "cudnn",
    "nccl",
    # NCCL's settings (determinism.NCCL_SETTINGS), in CUDA processes' fingerprints only
    "nccl.algo",
    "nccl.proto",
    "nccl.min_nchannels",
    "nccl.max_nchannels",
    "nccl.nvls_enable",
    "nccl.cross_nic",
)


# Without a kernel probe in the bundle (capture/probe.py) nothing shows that another CPU model
# computes alike, whatever a BLAS branch promises: the model is then compared too.
MODELS = ("cpu.model", "gpu.name")


def must_match(found: dict, probed: bool = True) -> dict:
    """The properties of ``found`` that a replay elsewhere must share to be compared bit for bit
    (``probed``: the bundle has a kernel probe, which judges what the list cannot)."""
    names = list(RESULT_AFFECTING) + (["cpu.model"] if found.get("cpu.blas_branch") is None else [])
    if not probed:
        names += [name for name in MODELS if name not in names]
    return {name: found[name] for name in names if name in found}


def fingerprint_differences(
    recorded: dict | None, now: dict | None, probed: bool = True
) -> list[str]:
    """``name: recorded X, here Y`` for every result-affecting property that differs
    (``probed``: see `must_match`).

    A property the record lacks (an older bundle) cannot be compared and is skipped.
    """
    if not recorded or now is None:
        return []
    return [
        f"{name}: recorded {value!r}, here {now.get(name)!r}"
        for name, value in must_match(recorded, probed).items()
        if value != now.get(name)
    ]


# PINNED_ENV (environment.py): the variables that choose CPU kernels; a device process puts
# the recorded values in force before its first operator (ATen reads the variable once, at
# the first dispatch; MKL at its first call).


def pinned_environment(recorded: dict | None) -> dict[str, str]:
    """The variables that put the recorded kernel choices in force in a new process.

    A variable the person set is left alone: the process's own fingerprint
    then shows whether the replay is comparable.
    """
    recorded = recorded or {}
    pinned = {}
    for prop, name in PINNED_ENV.items():
        value = recorded.get(prop)
        if isinstance(value, str) and value and os.environ.get(name) is None:
            pinned[name] = value.lower() if prop == "cpu.capability" else value
    return pinned


def check_environment(recorded: dict) -> None:
    """Refuse when a switch variable is set here to another value than in the recording."""
    conflicts = [
        f"{name}={os.environ[name]!r} (recorded {value!r})"
        for name, value in recorded.get("env", {}).items()
        if os.environ.get(name) is not None and os.environ[name] != value
    ]
    if conflicts:
        raise DeterminismError(
            "the environment differs from the recording: " + "; ".join(conflicts),
            "Unset those variables or set them to the recorded values, then replay again.",
        )
