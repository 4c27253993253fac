"""What a loop does around its step, restored rather than re-derived.

A loop sets the learning rate before the step (a schedule of its own, nanoGPT's
``get_lr(iter_num)``) and draws random numbers between micro-batches (a prefetch
that samples its next batch). Replay does not re-derive either: every optimizer
param group's hyperparameters are taken as each step begins and set back there,
and the torch generators' states are taken at each *restore point* of a step (each
input the loop feeds it, each entry of the root module's forward, or of each model
part's) and put back at
the same point of the replayed step, in order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..errors import WorkloadMismatchError
from ..workload.loop_objects import ModelParts

_SKIPPED = ("params",)


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's numeric hyperparameters (lr, betas, weight_decay, momentum...):
    numbers, tuples of numbers and tensors (copied); flags and names are not a schedule's."""
    groups = []
    for group in optimizer.param_groups:
        values: dict[str, Any] = {}
        for key, value in group.items():
            if key in _SKIPPED:
                continue
            if isinstance(value, torch.Tensor):
                values[key] = value.detach().to("cpu", copy=True)
            elif _numeric(value) or (
                isinstance(value, tuple) and value and all(_numeric(v) for v in value)
            ):
                values[key] = value
        groups.append(values)
    return groups


def set_hyperparameters(optimizer: torch.optim.Optimizer, recorded: list[dict[str, Any]]) -> None:
    """Put the hyperparameters `hyperparameters` took back into the optimizer's groups."""
    if len(recorded) != len(optimizer.param_groups):
        raise WorkloadMismatchError(
            f"the optimizer has {len(optimizer.param_groups)} param groups, the recording "
            f"{len(recorded)}: another optimizer than the recorded one"
        )
    for group, values in zip(optimizer.param_groups, recorded):
        for key, value in values.items():
            live = group.get(key)
            if isinstance(live, torch.Tensor) and isinstance(value, torch.Tensor):
                with torch.no_grad():
                    live.copy_(value)
            elif isinstance(value, list):  # a tuple stored as a list
                group[key] = tuple(value)
            else:
                group[key] = value


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def torch_rng(device: torch.device) -> dict[str, torch.Tensor]:
    """The torch generators a step's operators draw from: the CPU's and, on CUDA, the device's."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["accelerator"] = torch.cuda.get_rng_state(device)
    return state


def set_torch_rng(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if "accelerator" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["accelerator"], device)


class RestorePoints:
    """A step's restore points: noted while recording (``note``), put back in the same order
    while replaying (``restore``). ``root``: the module whose forward entries are points (a
    pre-hook, active only between ``begin`` and ``end``); of model parts, each part's."""

    def __init__(self, device: torch.device, root: torch.nn.Module | None = None):
        self.device = device
        self._noted: list[dict[str, torch.Tensor]] | None = None
        self._replayed: Iterator[dict[str, torch.Tensor]] | None = None
        roots = [] if root is None else list(root) if isinstance(root, ModelParts) else [root]
        self._handles = [
            module.register_forward_pre_hook(lambda *_: self.at_point("a forward entry"))
            for module in roots
        ]

    def begin_recording(self) -> None:
        self._noted, self._replayed = [], None

    def begin_replay(self, recorded: list[dict[str, torch.Tensor]]) -> None:
        self._noted, self._replayed = None, iter(recorded)

    def at_point(self, what: str) -> None:
        """A point of the open step: note the generators' states, or put the recorded back."""
        if self._noted is not None:
            self._noted.append(torch_rng(self.device))
        elif self._replayed is not None:
            state = next(self._replayed, None)
            if state is None:
                raise WorkloadMismatchError(
                    f"the replayed step reaches {what} the recorded step did not: the loop "
                    "feeds its step more inputs (or runs its model more often) than it did"
                )
            set_torch_rng(state, self.device)

    def end(self) -> list[dict[str, torch.Tensor]]:
        """Close the step: the states noted (recording), nothing (replaying)."""
        noted = self._noted or []
        self._noted, self._replayed = None, None
        return noted

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
