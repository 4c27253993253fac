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
import os
import site
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..errors import WorkloadError, message_of
from .loop_objects import loop_model, loop_optimizer


@dataclass
class Workload:
    """A model, its optimizer, batch *i*, and the training step the loop runs.

    ``get_batch(i)`` must return the same batch for the same ``i`` (tensors,
    or dicts/lists/tuples of them). The step is ``train_step(batch)`` when
    given: the whole step exactly as the loop runs it (micro-batches,
    clipping, GradScaler, ``optimizer.step()`` or not, schedulers, EMA,
    ``zero_grad``), returning the loss or None. Without it the step is
    ``loss_fn(model, batch).backward(); optimizer.step()`` (replay does
    exactly what the recorded loop did: it steps and zeroes gradients only
    where the loop did). ``state`` names the other objects the step changes
    (anything with ``state_dict()``/``load_state_dict()``: schedulers, a
    GradScaler, an EMA model, a step counter); their state is saved in the
    bundle and restored before replay.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    get_batch: Callable[[int], Any]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None
    train_step: Callable[[Any], torch.Tensor | None] | None = None
    state: dict[str, Any] = field(default_factory=dict)
    # The DistributedDataParallel the step runs ``model`` through, when ``model`` is the plain
    # module the bundle names (the Recorder needs it to know DDP's iterations before a step).
    data_parallel: torch.nn.Module | None = None

    def __post_init__(self) -> None:
        """A factory may return what its trainer hands over (model parts, an optimizer wrapper
        or container, several optimizers): the one module and optimizer replay reads, as the
        Recorder takes them (loop_objects.py)."""
        self.model = loop_model(self.model, "the workload")
        self.optimizer = loop_optimizer(self.optimizer, "the workload")

    def run_step(self, batch: Any) -> torch.Tensor | None:
        """One training step as `sdcreplay record` drives it: ``train_step``, or the default."""
        if self.train_step is not None:
            return self.train_step(batch)
        loss = self.loss(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss

    def loss(self, batch: Any) -> torch.Tensor:
        """``loss_fn``'s value, refused by name when it is not one number (backward needs one)."""
        if self.loss_fn is None:
            raise WorkloadError(
                "the workload has no loss_fn, so its step cannot be driven without train_step",
                "Give the Workload a loss_fn(model, batch) or a train_step(batch).",
            )
        loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise WorkloadError(
                f"the workload's loss_fn returned {shape}, not a scalar tensor",
                "Return the loss as one number (e.g. reduce it with .mean()).",
            )
        return loss


def check_state_objects(state: Any, where: str) -> dict[str, Any]:
    """Named state objects as a dict; each must save and load its state."""
    if not isinstance(state, dict):
        raise WorkloadError(
            f"{where}: state must be a dict of named objects, got {type(state).__name__}"
        )
    for name, obj in state.items():
        if not isinstance(name, str) or not name or not all(c.isalnum() or c in "_-" for c in name):
            raise WorkloadError(
                f"{where}: state object name {name!r} is not a plain name",
                "Name state objects with letters, digits, '_' and '-', e.g. 'scheduler'.",
            )
        if not (
            callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        ):
            raise WorkloadError(
                f"{where}: state object {name!r} ({type(obj).__name__}) has no "
                "state_dict()/load_state_dict()",
                "Wrap it in a small class with those two methods (see docs/recording.md).",
            )
    return dict(state)


BUILTIN_WORKLOADS = {
    "tiny-llama": "sdcreplay.workload.tiny_llama:make_workload",
    "tiny-moe": "sdcreplay.workload.tiny_moe:make_workload",
}
"""``builtin:NAME`` -> the factory's reference: built-ins are named like any workload, so
this module never imports them (they import `Workload` from here)."""


def builtin_names() -> list[str]:
    return sorted(BUILTIN_WORKLOADS)


def resolve_factory(ref: str) -> Callable[..., Workload]:
    """Turn ``builtin:NAME``, ``pkg.mod:fn`` or ``path/file.py:fn`` into a callable."""
    if ref.startswith("builtin:"):
        name = ref.removeprefix("builtin:")
        if name not in BUILTIN_WORKLOADS:
            raise WorkloadError(
                f"unknown built-in workload {name!r}",
                f"Built-in workloads: {', '.join('builtin:' + n for n in builtin_names())}.",
            )
        ref = BUILTIN_WORKLOADS[name]
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
                f"importing {target} raised {type(exc).__name__}: {message_of(exc)}",
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
    if spec is None or spec.loader is None:
        raise WorkloadError(
            f"{path} cannot be imported as a Python module",
            "Name a workload file ending in .py.",
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    # As `python file.py` would: the modules beside it import (a model.py next to train.py).
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise WorkloadError(
            f"loading {path} raised {type(exc).__name__}: {message_of(exc)}",
            "Fix the workload file; SDCREPLAY_DEBUG=1 shows the traceback.",
        ) from exc
    return module


def canonical_ref(ref: str) -> str:
    """The reference as a bundle stores it: one a fresh process in any directory resolves.

    ``path/file.py:fn`` gets an absolute path. ``module:fn`` for a single-file module found
    only through this process's directory or its script's (``python mytrain.py`` naming
    ``mytrain:make_workload``) becomes that file, ``/abs/dir/mytrain.py:fn``: a replay,
    started elsewhere without that directory on its path, could not import it. Anything else
    is kept as given (`recorded_ref` refuses what a replay could never import). Nothing is
    imported or run: the module is only located.
    """
    target, sep, attr = ref.rpartition(":")
    if not sep or not target or not attr or ref.startswith("builtin:"):
        return ref
    if target.endswith(".py"):
        return f"{Path(target).resolve()}:{attr}"
    found = _located(target)
    if found is not None and found.only_here and not found.package and "." not in target:
        return f"{found.origin}:{attr}"
    return ref


def recorded_ref(ref: str) -> str:
    """`canonical_ref`, refused (WorkloadError) when a replay could not import it: a module
    this process cannot find, or a package reachable only through this directory."""
    stored = canonical_ref(ref)
    target, sep, attr = stored.rpartition(":")
    if not sep or stored.startswith("builtin:") or target.endswith(".py"):
        return stored
    found = _located(target)
    file_hint = "Name the factory by its file instead, e.g. path/to/train.py:make_workload."
    if found is None:
        raise WorkloadError(
            f"workload {ref!r}: no module {target!r} can be found, so no replay could import it",
            f"Check the spelling and that it is importable here. {file_hint}",
        )
    if found.only_here:
        top = target.split(".")[0]
        raise WorkloadError(
            f"workload {ref!r}: package {top!r} is found only through this directory "
            f"({found.entry}), so a replay started elsewhere could not import it",
            f"Install it (pip install -e .), or put its directory on PYTHONPATH for the "
            f"recording and every replay. {file_hint}",
        )
    return stored


class _Location(NamedTuple):
    origin: Path  # the module's file, or its package's __init__.py (or directory)
    entry: Path  # the directory on sys.path it is found through
    package: bool
    only_here: bool  # found only through this process's directory or its script's


def _located(target: str) -> _Location | None:
    """Where the top-level module of ``target`` lives; None when it cannot be found. The
    module is located, not imported (its code does not run)."""
    top = target.split(".")[0]
    loaded = sys.modules.get(top)
    try:
        spec = loaded.__spec__ if loaded is not None else importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    package = spec.submodule_search_locations is not None
    if spec.origin and spec.has_location:
        origin = Path(spec.origin).resolve()
    elif package:
        origin = Path(next(iter(spec.submodule_search_locations or []), ".")).resolve()
    else:
        return None  # built into the interpreter or frozen: every process has it
    entry = origin.parent.parent if package and origin.suffix == ".py" else origin.parent
    return _Location(origin, entry, package, _only_here(entry))


def _only_here(entry: Path) -> bool:
    """Is ``entry`` on the path only because of where this process runs (its current
    directory, its script's directory), not for every process (PYTHONPATH, site-packages)?"""
    here = {Path.cwd().resolve()}
    script = sys.argv[0] if sys.argv else ""
    if script and Path(script).is_file():
        here.add(Path(script).resolve().parent)
    if entry not in here:
        return False
    lasting = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    lasting += [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    return not any(os.path.isabs(p) and Path(p).resolve() == entry for p in lasting)


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
            f"workload {ref!r} raised {type(exc).__name__}: {message_of(exc)}",
            "Fix the workload entry point; SDCREPLAY_DEBUG=1 shows the traceback.",
        ) from exc
    if not isinstance(workload, Workload):
        raise WorkloadError(
            f"workload {ref!r} returned {type(workload).__name__}, not sdcreplay.Workload"
        )
    if workload.loss_fn is None and workload.train_step is None:
        raise WorkloadError(
            f"workload {ref!r} has neither loss_fn nor train_step",
            "Give the Workload a train_step(batch) (or a loss_fn(model, batch)).",
        )
    workload.state = check_state_objects(workload.state, f"workload {ref!r}")
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
