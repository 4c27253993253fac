"""From a divergent step to the first corrupted operator: the step's operator calls, the
operator-level replay on a suspect and a reference, isolation, and the report."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__, {"bisect": "localize", "BisectResult": "report", "list_calls": "ops"}
)
