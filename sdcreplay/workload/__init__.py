"""How to rebuild the training step: the `Workload` type, resolving ``builtin:NAME``,
``pkg.mod:fn`` and ``path/file.py:fn``, and the built-in reference workloads."""

from .._lazy import lazy_exports

__getattr__, __dir__ = lazy_exports(
    __name__,
    {name: "definition" for name in ("Workload", "build_workload", "resolve_factory")},
)
