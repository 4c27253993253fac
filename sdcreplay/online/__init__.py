"""Detectors inside training that drive the loop's own step: the same-device replay check
and the update detector; with a ring `Recorder` they dump the step that alarmed."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AttributeScalar": "step",
        "ConfigurationError": "step",
        "ReplayCheck": "replay_check",
        "SDCReplayMismatch": "stopping",
        "ScalarState": "step",
        "TrainingStopped": "stopping",
        "UpdateDetector": "update_detector",
        "PersistentFaultError": "stopping",
        "NonFiniteResultError": "stopping",
        "RecomputeLimitError": "stopping",
    },
)
