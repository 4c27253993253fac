"""Recording a bundle from training: the `Recorder` a loop calls, its ring of recent steps,
and `record`/`record_job`, which drive a workload's steps under it."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "Recorder": "recorder",
        "RecordSummary": "drive",
        "record": "drive",
        "record_job": "job",
    },
)
