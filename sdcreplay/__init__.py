"""sdcreplay: record, replay, diff, bisect and minimize silent data corruption in PyTorch training."""

__version__ = "0.1.0"

from .bundle import Bundle, describe  # noqa: E402
from .compare import compare_logs, vote  # noqa: E402
from .errors import SdcReplayError, WorkloadMismatchError  # noqa: E402
from .recorder import Recorder, record  # noqa: E402
from .replay import ReplaySession, replay_devices, replay_on_device  # noqa: E402
from .signature import SignatureLog, read_signature_log  # noqa: E402
from .workload import Workload, build_workload  # noqa: E402

__all__ = [
    "Bundle", "Recorder", "ReplaySession", "SdcReplayError", "SignatureLog", "Workload",
    "WorkloadMismatchError",
    "build_workload", "compare_logs", "describe", "read_signature_log", "record",
    "replay_devices", "replay_on_device", "vote",
]
