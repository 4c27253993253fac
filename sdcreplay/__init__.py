"""sdcreplay: record, replay, diff, bisect and minimize silent data corruption in PyTorch training.

The package is lazy (PEP 562): ``sdcreplay --help`` and ``sdcreplay info``
import neither torch nor the pipeline; a name below is imported on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_EXPORTS = {
    "Bundle": "bundle",
    "JobBundle": "bundle",
    "describe": "bundle",
    "compare_logs": "compare",
    "vote": "compare",
    "record_job": "distributed",
    "replay_job": "distributed",
    "SdcReplayError": "errors",
    "WorkloadMismatchError": "errors",
    "ReplayCheck": "online",
    "TrainingStopped": "online",
    "UpdateDetector": "online",
    "Recorder": "recorder",
    "record": "recorder",
    "ReplaySession": "replay",
    "replay_devices": "replay",
    "replay_on_device": "replay",
    "TrainingSnapshot": "snapshot",
    "SignatureLog": "signature",
    "read_signature_log": "signature",
    "Workload": "workload",
    "build_workload": "workload",
}

__all__ = [
    "Bundle",
    "JobBundle",
    "Recorder",
    "ReplayCheck",
    "ReplaySession",
    "SdcReplayError",
    "SignatureLog",
    "TrainingSnapshot",
    "TrainingStopped",
    "UpdateDetector",
    "Workload",
    "WorkloadMismatchError",
    "build_workload",
    "compare_logs",
    "describe",
    "read_signature_log",
    "record",
    "record_job",
    "replay_devices",
    "replay_job",
    "replay_on_device",
    "vote",
]

if TYPE_CHECKING:
    from .bundle import Bundle, JobBundle, describe
    from .compare import compare_logs, vote
    from .distributed import record_job, replay_job
    from .errors import SdcReplayError, WorkloadMismatchError
    from .online import ReplayCheck, TrainingStopped, UpdateDetector
    from .recorder import Recorder, record
    from .replay import ReplaySession, replay_devices, replay_on_device
    from .signature import SignatureLog, read_signature_log
    from .snapshot import TrainingSnapshot
    from .workload import Workload, build_workload


def __getattr__(name: str) -> Any:
    """Import the module that defines ``name`` on first access (and only then)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'sdcreplay' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
