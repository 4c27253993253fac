"""Re-executing a recorded step: the replay session, one process per device (and the worker
inside it), a job's ranks under torch.distributed, and the verdict over the replicas."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ReplaySession": "session",
        "ReplayReport": "replicas",
        "replay_devices": "replicas",
        "replay_on_device": "session",
        "replay_job": "job",
        "replaying": "script",
    },
)
