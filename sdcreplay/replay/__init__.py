"""Re-executing a recorded step: the replay session, one process per device (and the worker
inside it), a job's ranks under torch.distributed, and the verdict over the replicas."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "ReplaySession": "session",
        "ReplayReport": "session",
        "replay_devices": "session",
        "replay_on_device": "session",
        "replay_job": "job",
        "diff_jobs": "job",
    },
)
