"""How a detector is handed the loop's own step, which it drives instead of a recording of it.

The loop gives a ``Workload`` or its own model, optimizer and ``train_step``;
numbers the step changes outside every module (a token counter) come as
``ScalarState`` so a replay can put them back. A detector set up wrongly raises
``ConfigurationError``, which code written for TorchTitan's replayer catches as ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..errors import SdcReplayError
from ..workload.definition import Workload, check_state_objects


class ConfigurationError(SdcReplayError, ValueError):
    """A detector was given options or pieces it cannot work with: an ``SdcReplayError`` (its
    hint says what to pass) and a ``ValueError``, as a bad argument is in Python."""


class ScalarState(Protocol):
    """A number the step changes that lives outside every module (a token counter)."""

    def get(self) -> Any: ...

    def set(self, value: Any) -> None: ...


@dataclass
class AttributeScalar:
    """``owner.name`` as a ``ScalarState``: ``AttributeScalar(trainer, "ntokens_seen")``."""

    owner: Any
    name: str

    def get(self) -> Any:
        return getattr(self.owner, self.name)

    def set(self, value: Any) -> None:
        setattr(self.owner, self.name, value)


def _no_batches(index: int) -> Any:
    raise SdcReplayError(
        "an online detector is handed each batch by the loop and never asks for one",
        "Call detector.run_step(batch) with the loop's batch.",
    )


def _judged_inline(batch: Any) -> Any:
    raise ConfigurationError(
        "this UpdateDetector was given no train_step: it judges the steps an inline loop (or a "
        "trainer) runs, and cannot run one itself",
        "Wrap each step of the loop in `with detector.step():` (or a trainer callback judges "
        "them); build it with train_step= to call run_step(batch), which can also recompute.",
    )


def step_workload(
    workload: Workload | None,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    train_step: Callable[[Any], torch.Tensor | None] | None,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None,
    state: Mapping[str, Any] | None,
    who: str,
    *,
    inline: bool = False,
) -> Workload:
    """The step a detector drives: the Workload's, or one made of the loop's own pieces.
    ``inline``: the detector may also judge steps it does not run (an inline loop's, given no
    ``train_step``), so model and optimizer are enough."""
    pieces = (model, optimizer, train_step, loss_fn, state)
    if workload is not None:
        if any(piece is not None for piece in pieces):
            raise ConfigurationError(
                f"{who} was given a Workload and also model/optimizer/train_step",
                "Give either a Workload or model=, optimizer= and train_step= (or loss_fn=).",
            )
        return workload
    if model is not None and optimizer is not None and train_step is None and loss_fn is None:
        if not inline:
            raise ConfigurationError(
                f"{who} re-executes a step in this process (a reference and its replays), and "
                "an inline loop's body runs once: it needs the step as a function",
                "Give it train_step= (the loop's whole step; call check.run_step(batch)). In an "
                "inline loop (`with rec.step():`), judge steps with UpdateDetector(model=, "
                "optimizer=, recorder=rec) and `with detector.step():`; `sdcreplay replay "
                "BUNDLE --device ...` re-runs a dumped bundle's steps through the script "
                '(docs/online.md, "In an inline loop").',
            )
        train_step = _judged_inline
    if model is None or optimizer is None or (train_step is None and loss_fn is None):
        raise ConfigurationError(
            f"{who} needs a Workload, or model=, optimizer= and train_step= (or loss_fn=)",
            "train_step(batch) is the loop's whole step: forward, backward(s), clipping, "
            "optimizer.step(), scheduler, zero_grad; it returns the loss.",
        )
    return Workload(
        model=model,
        optimizer=optimizer,
        get_batch=_no_batches,
        loss_fn=loss_fn,
        train_step=train_step,
        state=check_state_objects(dict(state or {}), who),
    )
