"""Deterministic switches, the environment a run happened in, and RNG state.

Replay is only evidence if a healthy device reproduces the record bit for bit,
so the switches are part of the record and replay refuses to run without them.
"""

from __future__ import annotations

import json
import os
import platform
import random
import re
import socket
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import DeterminismError
from ..ledger.identity import cpu_model
from .comparable import check_environment, pinned_environment
from .environment import SWITCH_ENV_VARS

# SWITCH_ENV_VARS (environment.py): the variables that change which kernels run (and so
# the bits they produce); they must match between record and replay.
# NCCL's result-affecting settings as fingerprint properties of a CUDA process: the reduction
# order follows the algorithm, protocol and channels, and NVLS reductions differ between calls.
NCCL_SETTINGS = {
    f"nccl.{name.removeprefix('NCCL_').lower()}": name
    for name in SWITCH_ENV_VARS
    if name.startswith("NCCL_")
}
# Recorded for the ticket and for a human reading `info`, never enforced.
INFO_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "PYTORCH_CUDA_ALLOC_CONF",
    "CUDA_LAUNCH_BLOCKING",
    "TORCH_CUDNN_V8_API_DISABLED",
)
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def current_switches() -> dict:
    """The switches in force in this process, in the manifest's form."""
    return {
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
        "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "num_threads": torch.get_num_threads(),
        "env": {name: os.environ.get(name) for name in SWITCH_ENV_VARS},
    }


def enable(num_threads: int | None = None) -> dict:
    """Turn every determinism switch on (keeping env values the user set) and return them."""
    for name, value in DETERMINISTIC_ENV.items():
        os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    return current_switches()


def apply(recorded: dict) -> None:
    """Put the recorded switches in force; refuse what cannot be changed from here.

    An environment variable the person set to another value is not overridden:
    they may have a reason, and the replay would not be evidence either way.
    """
    check_environment(recorded)
    for name, value in recorded.get("env", {}).items():
        if value is not None:
            os.environ[name] = value
    torch.use_deterministic_algorithms(bool(recorded["deterministic_algorithms"]))
    torch.backends.cudnn.deterministic = bool(recorded["cudnn_deterministic"])
    torch.backends.cudnn.benchmark = bool(recorded["cudnn_benchmark"])
    torch.backends.cuda.matmul.allow_tf32 = bool(recorded["cuda_matmul_allow_tf32"])
    torch.backends.cudnn.allow_tf32 = bool(recorded["cudnn_allow_tf32"])
    torch.set_float32_matmul_precision(recorded["float32_matmul_precision"])
    torch.set_num_threads(int(recorded["num_threads"]))


def verify(recorded: dict) -> None:
    """Raise DeterminismError naming every switch that differs from the record."""
    now = current_switches()
    differences = [
        f"{key}: recorded {recorded.get(key)!r}, now {now[key]!r}"
        for key in now
        if key != "env" and recorded.get(key) != now[key]
    ]
    differences += [
        f"{name}: recorded {value!r}, now {now['env'].get(name)!r}"
        for name, value in recorded.get("env", {}).items()
        if now["env"].get(name, os.environ.get(name)) != value
    ]
    if differences:
        raise DeterminismError(
            "the determinism switches in force differ from the recording: "
            + "; ".join(differences),
            "Let replay apply the recorded switches (the default), "
            "or set them as `sdcreplay info` shows.",
        )


def device_description(device: torch.device) -> dict:
    """Name and identity of the device a step runs on (UUID where it has one)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "index": index,
            "name": props.name,
            "uuid": str(getattr(props, "uuid", "")),
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": props.total_memory,
        }
    return {"type": device.type, "name": cpu_model(), "cores": os.cpu_count()}


def environment(device: torch.device) -> dict:
    """Everything a ticket or a replay warning needs about where a run happened."""
    return {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "numpy": np.__version__,
        "device": device_description(device),
        "env": {name: os.environ.get(name) for name in SWITCH_ENV_VARS + INFO_ENV_VARS},
    }


def environment_warnings(recorded: dict, now: dict) -> list[str]:
    """Differences that do not stop a replay but weaken it as evidence."""
    warnings = []
    if recorded.get("torch") != now.get("torch"):
        warnings.append(
            f"torch {now.get('torch')} replays a recording made with torch {recorded.get('torch')}"
        )
    old, new = recorded.get("device", {}), now.get("device", {})
    if old.get("type") == new.get("type") and old.get("name") != new.get("name"):
        warnings.append(
            f"device model {new.get('name')!r} replays a recording made on {old.get('name')!r}"
        )
    return warnings


@dataclass
class RngState:
    """Every generator a step may draw from, captured exactly."""

    python: tuple
    numpy: tuple
    cpu: torch.Tensor
    accelerator: torch.Tensor | None = None
    extra: dict = field(default_factory=dict)

    def signature_items(self) -> list[tuple[str, torch.Tensor]]:
        """Signature entries (name, value) for this state, compared in full."""
        python_state = torch.tensor(self.python[1], dtype=torch.int64)
        keys = np.asarray(self.numpy[1], dtype=np.uint32)
        numpy_state = torch.from_numpy(np.append(keys, np.uint32(self.numpy[2])))
        items = [("rng:python", python_state), ("rng:numpy", numpy_state), ("rng:cpu", self.cpu)]
        if self.accelerator is not None:
            items.append(("rng:cuda", self.accelerator))
        return items

    def python_json(self) -> str:
        return json.dumps([self.python[0], list(self.python[1]), self.python[2]])

    @staticmethod
    def python_from_json(text: str) -> tuple:
        version, internal, gauss = json.loads(text)
        return (version, tuple(internal), gauss)


def seed_everything(seed: int) -> None:
    """Seed every generator a step may draw from, so two recordings of a run are identical."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng(device: torch.device) -> RngState:
    """The Python, NumPy, torch CPU and (for a CUDA step) that device's generator."""
    accelerator = None
    if device.type == "cuda":
        accelerator = torch.cuda.get_rng_state(device)
    numpy_state = np.random.get_state(legacy=True)
    if not isinstance(numpy_state, tuple):  # a dict only for a non-MT19937 global generator
        raise DeterminismError(
            "NumPy's global random generator is not the MT19937 one numpy.random.seed makes",
            "Do not replace numpy.random's global generator in the workload.",
        )
    return RngState(
        python=random.getstate(),
        numpy=numpy_state,
        cpu=torch.get_rng_state(),
        accelerator=accelerator,
    )


def restore_rng(state: RngState, device: torch.device) -> None:
    """Put a captured state back; the accelerator state goes to *this* run's device."""
    random.setstate(state.python)
    np.random.set_state(state.numpy)
    torch.set_rng_state(state.cpu)
    if state.accelerator is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state.accelerator, device)


def capture_operator_rng(device: torch.device) -> dict:
    """The generators a random operator on ``device`` draws from, before the call."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_operator_rng(state: dict | None, device: torch.device) -> None:
    """Give a call re-run alone the random numbers it drew in the step."""
    if not state:
        return
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------
# Environment fingerprint: every property of the machine and software that can
# change a result bit. Two machines whose fingerprints differ in one of these
# can disagree without either being defective.

_SIMD_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "asimd",
    "sve",
)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            line = next((line for line in handle if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = ""
    present = set(line.split(":", 1)[-1].split())
    return " ".join(flag for flag in _SIMD_FLAGS if flag in present)


def _config_version(pattern: str) -> str | None:
    match = re.search(pattern, torch.__config__.show())
    return match.group(1) if match else None


def _nccl_version() -> str | None:
    """NCCL's version where torch was built with it (a CPU-only or ROCm build may not be)."""
    try:
        from torch.cuda import nccl

        version = nccl.version()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _gpu_fingerprint(device: torch.device) -> dict:
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    uuid = str(getattr(props, "uuid", ""))
    return {
        "gpu.name": props.name,
        "gpu.capability": f"{props.major}.{props.minor}",
        "gpu.sm_count": props.multi_processor_count,
        "gpu.mig": "MIG" in props.name
        or uuid.startswith("MIG")
        or "MIG-" in os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        "driver": _driver_version(),
        "cuda.runtime": torch.version.cuda,
        "cublas": _loaded_library_version("libcublas.so"),
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "nccl": _nccl_version(),
        **{prop: os.environ.get(name) for prop, name in NCCL_SETTINGS.items()},
    }


def _driver_version() -> str | None:
    try:
        with open("/proc/driver/nvidia/version") as handle:
            match = re.search(r"Kernel Module\s+(\S+)", handle.read())
    except OSError:
        return None
    return match.group(1) if match else None


def _loaded_library_version(stem: str) -> str | None:
    """The version suffix of a shared library this process loaded (``libcublas.so.12.4.5``)."""
    try:
        with open("/proc/self/maps") as handle:
            names = {line.split()[-1] for line in handle if stem in line}
    except OSError:
        return None
    versions = sorted(name.rsplit(stem, 1)[-1].lstrip(".") for name in names)
    return versions[-1] if versions else None


def fingerprint(device: torch.device) -> dict:
    """This process's fingerprint, as the operators it runs see it.

    It reads the CPU capability ATen dispatches with, so take it after any
    pinning (``pin_environment``) and, in a device process, after the run.
    """
    found = {
        "torch.version": torch.__version__,
        "torch.git": torch.version.git_version,
        "cpu.model": cpu_model(),
        "cpu.flags": _cpu_flags(),
        "cpu.capability": torch.backends.cpu.get_cpu_capability(),
        "cpu.blas_branch": os.environ.get("MKL_CBWR"),
        "mkl": _config_version(r"Math Kernel Library Version (\S+)"),
        "onednn": _config_version(r"MKL-DNN v(\S+)"),
        "threads.intra_op": torch.get_num_threads(),
        "threads.inter_op": torch.get_num_interop_threads(),
    }
    if device.type == "cuda":
        found.update(_gpu_fingerprint(device))
    return found


def pin_environment(recorded: dict | None) -> None:
    """Call before the first operator of a process that replays a recording."""
    os.environ.update(pinned_environment(recorded))
