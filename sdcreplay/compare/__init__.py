"""Two signature logs side by side: structure first, values second, the vote between
record and replicas, which bits of which elements differ, and pictures of it."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        name: "logs"
        for name in ("Comparison", "Consensus", "Divergence", "compare_logs", "diff", "vote")
    },
)
