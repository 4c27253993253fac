"""The ring buffer behind ``Recorder(ring=K)``: the last K steps in bounded memory.

A job records all the time and writes nothing until an alarm asks for a bundle (under
torch.distributed every rank holds its own steps, and their dumps form one job bundle).
Replay needs the state a bundle's first step starts from, so the ring keeps
*windows*: a state snapshot (``TrainingSnapshot``, on the CPU) taken as a step
begins, and the steps recorded from it. A new window opens at the first step
that begins once the current window holds K steps (and at an optimizer-step
boundary: gradients carried into a step are not in a bundle); as soon as the
newest window holds K steps the older one is dropped. So the ring always covers
the last K steps (or every step so far), and holds at most two snapshots and
2K - 1 steps (batches, RNG states, signature entries) at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..capture.determinism import RngState
from ..capture.snapshot import TrainingSnapshot
from ..storage.tensorio import map_tensors

if TYPE_CHECKING:
    from ..capture.message import Message


@dataclass
class HeldStep:
    """One recorded step, as ``BundleWriter.add_step`` takes it; under torch.distributed with
    its logged collectives and the DDP's iterations before it (a window's first step's go in
    its job part's manifest)."""

    index: int
    batch: Any  # a CPU copy
    rng: RngState
    entries: list[tuple[str, str]]
    optimizer_step: bool
    grads: str
    seconds: float
    messages: list[Message] | None = None
    ddp_iterations_before: int | None = None
    stopped: bool = False  # a detector stopped it before its optimizer's update

    @cached_property  # asked after every step, for every held step
    def nbytes(self) -> int:
        """Tensor bytes (batch, RNG states) and signature characters; not Python's overhead."""
        tensors = [self.rng.cpu, self.rng.accelerator]
        map_tensors(self.batch, tensors.append)
        data = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        keys = np.asarray(self.rng.numpy[1])
        return data + keys.nbytes + sum(len(n) + len(d) for n, d in self.entries)


@dataclass
class Window:
    start: TrainingSnapshot  # the state as ``steps[0]`` began
    steps: list[HeldStep]


class StepRing:
    """Windows of recorded steps covering at least the last ``size`` steps."""

    def __init__(self, size: int):
        self.size = size
        self._windows: list[Window] = []

    def wants_snapshot(self, grads: str) -> bool:
        """As a step begins: must a new window start here? Not where gradients are carried in
        (a bundle starts from parameters and optimizer state, never from gradients)."""
        if grads == "kept":
            return False
        if not self._windows:
            return True
        held = len(self._windows[-1].steps)
        return held == 0 or held >= self.size

    def open_window(self, snapshot: TrainingSnapshot) -> None:
        """A window starting now (replacing a newest window whose only step never ended)."""
        if self._windows and not self._windows[-1].steps:
            self._windows.pop()
        self._windows.append(Window(snapshot, []))

    def drop_last(self) -> HeldStep | None:
        """Take back the newest held step; its window stays, starting from the state before it
        (the snapshot of an emptied window is that state)."""
        for window in reversed(self._windows):
            if window.steps:
                return window.steps.pop()
        return None

    def clear(self) -> None:
        """Forget every step: a step that raised mid-way left the state between two steps, so
        no later step continues the held ones."""
        self._windows = []

    def add(self, step: HeldStep) -> bool:
        """Hold a step that completed; False where no window is open (the loop began with
        gradients carried in, so no bundle could start at it)."""
        if not self._windows:
            return False
        newest = self._windows[-1]
        newest.steps.append(step)
        if len(newest.steps) >= self.size:
            self._windows = [newest]  # it alone covers the last K steps
        return True

    @property
    def start(self) -> TrainingSnapshot | None:
        """The state the oldest held step began from."""
        held = [window for window in self._windows if window.steps]
        return held[0].start if held else None

    @property
    def steps(self) -> list[HeldStep]:
        """Every held step, oldest first (the windows follow each other without a gap)."""
        return [step for window in self._windows for step in window.steps]

    @property
    def nbytes(self) -> int:
        return sum(
            window.start.nbytes + sum(step.nbytes for step in window.steps)
            for window in self._windows
        )


def model_state_dict(snapshot: TrainingSnapshot) -> dict[str, torch.Tensor]:
    """The snapshot's parameters and buffers under ``state_dict`` names (tied weights under
    each name, non-persistent buffers left out), as the bundle's ``state.h5`` holds them."""
    copies: dict[int, torch.Tensor] = {}
    for name, param in snapshot.model.named_parameters():
        copies[id(param)] = snapshot.params[name]
    for name, buffer in snapshot.model.named_buffers():
        copies[id(buffer)] = snapshot.buffers[name]
    live = snapshot.model.state_dict(keep_vars=True)
    return {name: copies[id(tensor)] for name, tensor in live.items()}
