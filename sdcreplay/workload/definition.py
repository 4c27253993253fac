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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import WorkloadError, message_of
from .loop_objects import loop_model, loop_optimizer
from .references import BUILTIN_WORKLOADS, builtin_names


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
