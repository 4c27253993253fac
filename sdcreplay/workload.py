"""What a training step is made of, and how to rebuild it from a name.

A bundle stores the workload's *name* and keyword arguments, never code: replay
calls the same factory again, so only an entry point the person names on the
command line ever runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import WorkloadError


@dataclass
class Workload:
    """A model, its optimizer, batch *i* and the loss of a batch.

    ``get_batch(i)`` must return the same batch for the same ``i`` (tensors,
    or dicts/lists/tuples of them); ``loss_fn(model, batch)`` returns a scalar.
    A training step is ``loss_fn(...).backward(); optimizer.step();
    optimizer.zero_grad()``.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    get_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]


def _builtin_factories() -> dict[str, Callable[..., Workload]]:
    from .workloads import tiny_llama, tiny_moe

    return {"tiny-llama": tiny_llama.make_workload, "tiny-moe": tiny_moe.make_workload}


def builtin_names() -> list[str]:
    return sorted(_builtin_factories())


def resolve_factory(ref: str) -> Callable[..., Workload]:
    """Turn ``builtin:NAME``, ``pkg.mod:fn`` or ``path/file.py:fn`` into a callable."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        factories = _builtin_factories()
        if name not in factories:
            raise WorkloadError(
                f"unknown built-in workload {name!r}",
                f"Built-in workloads: {', '.join('builtin:' + n for n in sorted(factories))}.",
            )
        return factories[name]
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr:
        raise WorkloadError(f"cannot read workload reference {ref!r}")
    if target.endswith(".py"):
        module = _load_file(Path(target))
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise WorkloadError(
                f"cannot import module {target!r} for workload {ref!r}: {exc}",
                "Check the module is on PYTHONPATH (or give a path/to/file.py:function).",
            ) from exc
        except Exception as exc:  # the module itself raised while importing
            raise WorkloadError(
                f"importing {target} raised {type(exc).__name__}: {exc}",
                "Fix the workload module; SDCREPLAY_DEBUG=1 shows the traceback.",
            ) from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise WorkloadError(f"{target} has no function {attr!r}")
    return factory


def _load_file(path: Path):
    if not path.is_file():
        raise WorkloadError(f"workload file {str(path)!r} does not exist")
    name = f"_sdcreplay_workload_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise WorkloadError(
            f"loading {path} raised {type(exc).__name__}: {exc}",
            "Fix the workload file; SDCREPLAY_DEBUG=1 shows the traceback.",
        ) from exc
    return module


def canonical_ref(ref: str) -> str:
    """A ``file.py:fn`` reference with an absolute path, so replay works from any directory."""
    target, sep, attr = ref.rpartition(":")
    if sep and target.endswith(".py") and not ref.startswith("builtin:"):
        return f"{Path(target).resolve()}:{attr}"
    return ref


def build_workload(ref: str, kwargs: dict[str, Any] | None = None) -> Workload:
    """Call the factory with ``kwargs`` under a fixed seed; wrap its errors."""
    factory = resolve_factory(ref)
    kwargs = dict(kwargs or {})
    signature = _signature(ref, factory)
    if signature is not None:
        try:
            signature.bind(**kwargs)
        except TypeError as exc:
            raise WorkloadError(
                f"workload {ref!r} does not take these arguments: {exc}",
                f"Its signature is {ref}{signature}.",
            ) from exc
    try:
        seed = operator.index(kwargs.get("seed", 0))
    except TypeError as exc:
        raise WorkloadError(
            f"workload seed must be an integer, got {kwargs.get('seed')!r}",
            "Pass --seed N (or -a seed=N) with a whole number.",
        ) from exc
    torch.manual_seed(seed)
    try:
        workload = factory(**kwargs)
    except Exception as exc:
        raise WorkloadError(
            f"workload {ref!r} raised {type(exc).__name__}: {exc}",
            "Fix the workload entry point; SDCREPLAY_DEBUG=1 shows the traceback.",
        ) from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload {ref!r} returned {type(workload).__name__}, not sdcreplay.Workload"
        )
    return workload


def _signature(ref: str, factory: Callable[..., Workload]) -> inspect.Signature | None:
    """The factory's signature, or None for a callable Python cannot introspect."""
    try:
        return inspect.signature(factory)
    except (TypeError, ValueError):
        return None


def accepts_seed(ref: str) -> bool:
    signature = _signature(ref, resolve_factory(ref))
    if signature is None:
        return False
    params = signature.parameters
    return "seed" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
