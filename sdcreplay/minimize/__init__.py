"""From one corrupted operator to a hardware ticket: repeated trials with a failure rate,
shrinking the inputs while it still fails, and the standalone reproducer."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(__name__, {"minimize": "driver", "MinimizeResult": "driver"})
