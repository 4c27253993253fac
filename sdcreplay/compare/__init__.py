"""Two signature logs side by side: structure first, values second, the vote between
record and replicas, which bits of which elements differ, and pictures of it; for a job,
each rank's messages among its entries and the rank where it first went wrong."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        **{
            name: "logs"
            for name in (
                "Comparison",
                "Consensus",
                "Divergence",
                "compare_logs",
                "diff",
                "load_log",
                "vote",
            )
        },
        "diff_jobs": "jobs",
    },
)
