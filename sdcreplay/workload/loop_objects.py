"""The model and optimizer a training loop hands over, as the one module and the one torch
optimizer the rest of sdcreplay reads.

Real trainers hand over more than a torch optimizer and a module. Accelerate wraps its
optimizer (``AcceleratedOptimizer``: the real one at ``.optimizer``, without torch's step
hooks); TorchTitan's ``OptimizersContainer`` is a torch optimizer whose ``state_dict()`` is
flat and keyed by parameter name, its real optimizers (one per model part) at
``.optimizers``; a loop may step several optimizers; a pipeline's rank holds a list of model
parts. ``loop_optimizer`` turns any of these into one torch optimizer (an `OptimizerSet` of
several) and ``loop_model`` the parts into one module, recognised by their shape (duck
typing: no trainer is imported), so that recording and replay, which both call them, see the
same objects under the same names, and what cannot be taken is refused as it is given.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import WorkloadError

_FORMS = (
    "Pass the torch.optim.Optimizer the loop steps (optimizer=opt), several as a list "
    "(optimizer=[opt1, opt2]), or what the trainer hands over: a wrapper holding it at "
    ".optimizer (Accelerate's AcceleratedOptimizer) or a container holding them at .optimizers "
    "(TorchTitan's OptimizersContainer); docs/porting.md."
)
_DEPTH = 8  # wrappers inside containers inside wrappers: more is a cycle


class OptimizerSet(torch.optim.Optimizer):
    """Several torch optimizers a step steps each once, seen as one optimizer: their param
    groups in order, their state, one state_dict in the form of one optimizer's (parameters
    numbered across them all, so a bundle keeps it as it keeps any optimizer's), and step
    hooks around the step of them all (the pre-hooks as the first one begins, the post-hooks
    once every one has stepped).

    torch's ``Optimizer.__init__`` is not run: the groups and the state are the optimizers'
    own, and the hooks are theirs, relayed."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers
        self._pre: OrderedDict[int, Callable] = OrderedDict()
        self._post: OrderedDict[int, Callable] = OrderedDict()
        self._stepped: set[int] | None = None  # which have stepped in the step under way
        for optimizer in optimizers:
            optimizer.register_step_pre_hook(self._one_begins)
            optimizer.register_step_post_hook(self._one_ended)

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> Mapping[torch.Tensor, Any]:  # type: ignore[override]
        return _States(self.optimizers)

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizers[0].defaults

    def register_step_pre_hook(self, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(self._pre)
        self._pre[handle.id] = hook
        return handle

    def register_step_post_hook(self, hook: Callable) -> RemovableHandle:
        handle = RemovableHandle(self._post)
        self._post[handle.id] = hook
        return handle

    def _one_begins(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        # One that steps again opens the next step (a step that did not step them all).
        if self._stepped is not None and id(optimizer) not in self._stepped:
            return
        self._stepped = set()
        try:
            for hook in list(self._pre.values()):
                hook(self, args, kwargs)
        except BaseException:  # a hook that stops the step (a detector): no step is under way
            self._stepped = None
            raise

    def _one_ended(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._stepped is None:
            return
        self._stepped.add(id(optimizer))
        if len(self._stepped) == len(self.optimizers):
            self._stepped = None
            for hook in list(self._post.values()):
                hook(self, args, kwargs)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise WorkloadError(
            "add_param_group() on several optimizers: which one is meant?",
            "Add the group to the optimizer it belongs to.",
        )

    def state_dict(self) -> dict[str, Any]:
        """One optimizer's state_dict of them all: the groups in order, the parameters
        numbered from 0 across them (each optimizer's after the one before's)."""
        state: dict[int, Any] = {}
        groups: list[dict[str, Any]] = []
        for optimizer in self.optimizers:
            own = optimizer.state_dict()
            numbers = _renumbering(own["param_groups"], start=len(_params(groups)))
            groups += [
                {**group, "params": [numbers[p] for p in group["params"]]}
                for group in own["param_groups"]
            ]
            state.update((numbers[p], value) for p, value in own["state"].items())
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Each optimizer its own groups of ``state_dict`` (as many as it has, in order), its
        parameters numbered from 0 again."""
        groups = list(state_dict["param_groups"])
        if len(groups) != len(self.param_groups):
            raise WorkloadError(
                f"the saved optimizer state has {len(groups)} param groups, the loop's "
                f"{len(self.optimizers)} optimizers {len(self.param_groups)}",
                "Build the same optimizers, with the same param groups, as when it was saved.",
            )
        for optimizer in self.optimizers:
            count = len(optimizer.param_groups)
            own, groups = groups[:count], groups[count:]
            numbers = _renumbering(own, start=0)
            optimizer.load_state_dict(
                {
                    "state": {
                        numbers[p]: value
                        for p, value in state_dict["state"].items()
                        if p in numbers
                    },
                    "param_groups": [
                        {**group, "params": [numbers[p] for p in group["params"]]} for group in own
                    ],
                }
            )


class _States(Mapping):
    """The optimizers' per-parameter state, read where it is (each lookup asks each
    optimizer: no merged copy per parameter)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self._optimizers = optimizers

    def __getitem__(self, param: torch.Tensor) -> Any:
        for optimizer in self._optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        raise KeyError(param)

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (param for optimizer in self._optimizers for param in optimizer.state)

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._optimizers)


def _params(groups: list[dict[str, Any]]) -> list[Any]:
    return [param for group in groups for param in group["params"]]


def _renumbering(groups: list[dict[str, Any]], start: int) -> dict[Any, int]:
    """Each parameter number of ``groups`` -> its place among them, from ``start``."""
    return {param: start + place for place, param in enumerate(_params(groups))}


def loop_optimizer(given: Any, where: str = "Recorder") -> torch.optim.Optimizer:
    """The one torch optimizer of what the loop hands over (``given``): itself, the real one
    inside a wrapper, or an `OptimizerSet` of several; refused with the forms it takes."""
    if isinstance(given, OptimizerSet):
        return given
    found: list[torch.optim.Optimizer] = []
    for optimizer in _real_optimizers(given, where, _DEPTH):
        if all(optimizer is not other for other in found):
            found.append(optimizer)
    if not found:
        raise WorkloadError(f"{where}: optimizer= holds no optimizer", _FORMS)
    for optimizer in found:
        _check_state_form(optimizer, where)
    return found[0] if len(found) == 1 else OptimizerSet(found)


def _real_optimizers(given: Any, where: str, depth: int) -> list[torch.optim.Optimizer]:
    """The torch optimizers that step, inside lists, wrappers and containers."""
    inner = getattr(given, "optimizers", None)  # a container (TorchTitan's): its parts'
    if isinstance(given, (list, tuple)):
        inner = given
    elif not isinstance(inner, (list, tuple)):
        if isinstance(given, torch.optim.Optimizer) and hasattr(given, "_optimizer_step_pre_hooks"):
            return [given]  # a torch optimizer (its __init__ ran: it has torch's step hooks)
        wrapped = getattr(given, "optimizer", None)  # a wrapper (Accelerate's): the real one
        inner = None if wrapped is None or wrapped is given else [wrapped]
    if inner is None or depth == 0:
        raise WorkloadError(
            f"{where}: optimizer={type(given).__name__} is not a torch optimizer, nor a "
            "wrapper or container of one",
            _FORMS,
        )
    return [found for item in inner for found in _real_optimizers(item, where, depth - 1)]


def _check_state_form(optimizer: torch.optim.Optimizer, where: str) -> None:
    """A bundle keeps an optimizer's state as torch's state_dict (state, param_groups)."""
    try:
        saved = optimizer.state_dict()
        keys = repr(sorted(saved)) if isinstance(saved, dict) else type(saved).__name__
    except Exception as exc:  # a sharded optimizer that must be consolidated first...
        keys = f"an error: {str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}"
    if keys != repr(["param_groups", "state"]):
        raise WorkloadError(
            f"{where}: {type(optimizer).__name__}.state_dict() gives {keys}, not torch's "
            "optimizer state_dict (state, param_groups), which a bundle keeps",
            _FORMS,
        )


class ModelParts(torch.nn.ModuleList):
    """A rank's model parts (a pipeline's stages) as one module: their parameters named by
    each part's place (``0.``, ``1.``...). It runs no forward of its own: each part's is an
    entry of the model's forward (capture/around.py's restore points)."""


def loop_model(given: Any, where: str = "Recorder") -> torch.nn.Module:
    """The one module of what the loop hands over: itself, or its model parts (a pipeline's
    stages on this rank, a list) as `ModelParts`; refused with the forms it takes."""
    if isinstance(given, torch.nn.Module):
        return given
    if (
        isinstance(given, (list, tuple))
        and given
        and all(isinstance(part, torch.nn.Module) for part in given)
    ):
        return given[0] if len(given) == 1 else ModelParts(given)
    raise WorkloadError(
        f"{where}: model={type(given).__name__} is not a torch.nn.Module nor a list of them",
        "Pass the module the loop trains (model=model), or its model parts as a list "
        "(model=model_parts: a pipeline's stages on this rank, TorchTitan's model_parts).",
    )
