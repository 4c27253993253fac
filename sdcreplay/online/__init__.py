"""Detectors inside training that drive the loop's own step: the same-device replay check
and the update detector; with a ring `Recorder` they dump the step that alarmed."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        name: "replay_check"
        for name in (
            "AttributeScalar",
            "ReplayCheck",
            "SDCReplayMismatch",
            "ScalarState",
            "TrainingStopped",
            "UpdateDetector",
            "PersistentFaultError",
            "NonFiniteResultError",
            "RecomputeLimitError",
        )
    },
)
