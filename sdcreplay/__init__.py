"""sdcreplay: record, replay, diff, bisect and minimize silent data corruption in PyTorch training.

The folders follow the pipeline: ``workload`` -> ``capture`` -> ``bundle`` ->
``replay`` (with ``compare``) -> ``online`` and ``recording`` -> ``bisect`` ->
``minimize``; ``cli`` draws it for a person (docs/architecture.md).

The package is lazy (PEP 562): ``sdcreplay --help`` and ``sdcreplay info``
import neither torch nor the pipeline; a name below is imported on first use.
"""

from __future__ import annotations

from . import interrupts

# In the console script's process, before anything else is imported: a ^C or SIGTERM in its
# first second ends it as cleanly as one later.
interrupts.install_for_console_script()

# isort: split
from typing import TYPE_CHECKING  # noqa: E402

from . import moved  # noqa: E402
from ._lazy import lazy_exports  # noqa: E402

__version__ = "0.1.0"

_EXPORTS = {
    "Bundle": "bundle",
    "JobBundle": "bundle",
    "describe": "bundle",
    "compare_logs": "compare",
    "vote": "compare",
    "record_job": "recording",
    "replay_job": "replay",
    "SdcReplayError": "errors",
    "WorkloadMismatchError": "errors",
    "ReplayCheck": "online",
    "TrainingStopped": "online",
    "UpdateDetector": "online",
    "Recorder": "recording",
    "record": "recording",
    "ReplaySession": "replay",
    "replay_devices": "replay",
    "replay_on_device": "replay",
    "replaying": "replay",
    "TrainingSnapshot": "capture",
    "SignatureLog": "capture",
    "read_signature_log": "capture",
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
    "replaying",
    "vote",
]

if TYPE_CHECKING:
    from .bundle import Bundle, JobBundle, describe
    from .capture import SignatureLog, TrainingSnapshot, read_signature_log
    from .compare import compare_logs, vote
    from .errors import SdcReplayError, WorkloadMismatchError
    from .online import ReplayCheck, TrainingStopped, UpdateDetector
    from .recording import Recorder, record, record_job
    from .replay import ReplaySession, replay_devices, replay_job, replay_on_device, replaying
    from .workload import Workload, build_workload

moved.install()
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
