"""The ring buffer behind ``Recorder(ring=K)``: the last K steps in bounded memory.

A job records all the time and writes nothing until an alarm asks for a bundle (under
torch.distributed every rank holds its own steps, and their dumps form one job bundle).
Replay needs the state a bundle's first step starts from, so the ring keeps
*windows*: a state snapshot (``RingSnapshot``, on the CPU) taken as a step
begins, and the steps recorded from it. A new window opens at the first step
that begins once the current window holds K steps (and at an optimizer-step
boundary: gradients carried into a step are not in a bundle); as soon as the
newest window holds K steps the older one is dropped. So the ring always covers
the last K steps (or every step so far), and holds at most two snapshots and
2K - 1 steps (batches, RNG states, signature entries) at once.

A loop that saves checkpoints anchors the window on them instead (``anchor``, from
``Recorder.checkpoint_saved``): the window then starts at the last checkpoint and holds
every step since, with no snapshot. It holds at most ``max_window`` steps: a window that
outgrows it goes on from a snapshot taken then, K steps at a time as above, until the next
checkpoint (``window_note`` says so in each dump's trigger).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from ..capture.determinism import RngState
from ..capture.snapshot import TrainingSnapshot
from ..storage.tensorio import map_tensors
from .anchors import CheckpointAnchor

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
    around: dict | None = None  # what the loop set around it (capture/around.py)

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
    start: RingSnapshot | CheckpointAnchor  # the state as ``steps[0]`` began
    steps: list[HeldStep]

    @property
    def anchored(self) -> bool:
        """Does it start at a checkpoint of the loop's own?"""
        return isinstance(self.start, CheckpointAnchor)


class StepRing:
    """Windows of recorded steps covering at least the last ``size`` steps (or every step
    since the last checkpoint, at most ``max_window``)."""

    def __init__(self, size: int, max_window: int):
        self.size, self.max_window = size, max_window
        self._windows: list[Window] = []
        self.checkpoint: CheckpointAnchor | None = None  # the last one the loop saved
        self.outgrown_at: int | None = None  # the step its window outgrew max_window at

    def wants_snapshot(self, grads: str) -> bool:
        """As a step begins: must a new window start here? Not where gradients are carried in
        (a bundle starts from parameters and optimizer state, never from gradients), nor in a
        checkpoint's window short of ``max_window``."""
        if grads == "kept":
            return False
        if not self._windows:
            return True
        newest = self._windows[-1]
        held = len(newest.steps)
        if newest.anchored:
            return held >= self.max_window
        return held == 0 or held >= self.size

    def anchor(self, checkpoint: CheckpointAnchor) -> None:
        """The loop saved a checkpoint: the window starts there (no older step is needed)."""
        self._windows = [Window(checkpoint, [])]
        self.checkpoint, self.outgrown_at = checkpoint, None

    def open_window(self, snapshot: RingSnapshot) -> None:
        """A window starting now (replacing a newest window whose only step never ended)."""
        if self._windows and not self._windows[-1].steps:
            self._windows.pop()
        if self._windows and self._windows[-1].anchored:  # it outgrew max_window
            self.outgrown_at = self._windows[-1].steps[-1].index + 1
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
        if len(newest.steps) >= self.size and not newest.anchored:
            self._windows = [newest]  # it alone covers the last K steps
        return True

    def window_note(self) -> tuple[str, str | None]:
        """Where a dump now starts (``"checkpoint"`` or ``"snapshot"``) and, in words, what it
        holds when that is not simply the last steps from a copy of the state."""
        held = [window for window in self._windows if window.steps]
        if not held:
            return "snapshot", None
        first, last = held[0].steps[0].index, held[-1].steps[-1].index
        checkpoint = self.checkpoint
        if isinstance(held[0].start, CheckpointAnchor):
            anchor = held[0].start
            return "checkpoint", (
                f"steps {first}-{last}: every step since checkpoint {anchor.path} "
                f"(saved before step {anchor.before_step})"
            )
        if checkpoint is not None and self.outgrown_at is not None:
            return "snapshot", (
                f"the window since checkpoint {checkpoint.path} (saved before step "
                f"{checkpoint.before_step}) outgrew max_window={self.max_window} steps at step "
                f"{self.outgrown_at}; since then the ring copies the state every {self.size} "
                f"steps until the next checkpoint, and this bundle holds steps {first}-{last} "
                f"from its copy before step {first}"
            )
        return "snapshot", None

    def held_range(self) -> HeldRange:
        """Where a dump could start (each window's first step) and end (the newest step)."""
        held = [window for window in self._windows if window.steps]
        return HeldRange(
            [window.steps[0].index for window in held],
            held[-1].steps[-1].index if held else None,
        )

    def between(
        self, first: int, last: int
    ) -> tuple[RingSnapshot | CheckpointAnchor, list[HeldStep]]:
        """The held steps ``first``..``last`` and the state ``first`` began from (``first``
        starts a window: ``held_range``)."""
        for position, window in enumerate(self._windows):
            if window.steps and window.steps[0].index == first:
                steps = [s for w in self._windows[position:] for s in w.steps if s.index <= last]
                return window.start, steps
        raise ValueError(f"no held window starts at step {first}")

    @property
    def start(self) -> RingSnapshot | CheckpointAnchor | None:
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


@dataclass
class HeldRange:
    """What a rank's ring holds, told to the other ranks before a job's dump: the first step
    of each window (where a bundle can start) and the newest step (None: nothing held)."""

    starts: list[int]
    last: int | None

    def describe(self) -> str:
        return "no step" if self.last is None else steps_text(self.starts[0], self.last)


def steps_text(first: int, last: int) -> str:
    """``step 5`` or ``steps 3-5``."""
    return f"step {last}" if first == last else f"steps {first}-{last}"


def common_window(ranges: list[HeldRange]) -> tuple[int, int] | None:
    """The steps every rank's ring holds, from the oldest window start they share to the
    earliest rank's newest step; None where there are none."""
    if any(held.last is None for held in ranges):
        return None
    last = min(held.last for held in ranges if held.last is not None)
    shared = set.intersection(*(set(held.starts) for held in ranges))
    firsts = [first for first in shared if first <= last]
    return (min(firsts), last) if firsts else None


@dataclass
class RingSnapshot(TrainingSnapshot):
    """A window's copy of the state: a ``TrainingSnapshot`` on the CPU, and the model's state
    dict as ``state_dict()`` returned it then (what a bundle's ``state.h5`` holds), whatever
    its hooks build: its parameters and buffers are the snapshot's copies (tied weights under
    each name, non-persistent buffers left out), the tensors its hooks made (a fused weight
    split into its parts) copied as well."""

    model_state: dict[str, torch.Tensor] = field(default_factory=dict)
    built: int = 0  # bytes of the tensors the state_dict's hooks made

    @classmethod
    def copy(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state_objects: dict[str, Any],
    ) -> RingSnapshot:
        """Copy the state as a step begins (from a GPU without making the step wait for the
        parameters: ``TrainingSnapshot.take``'s ``non_blocking``)."""
        taken = cls.take(  # made by cls(...): a RingSnapshot
            model, optimizer, state_objects, grads=False, rng=False, device="cpu",
            non_blocking=True,
        )  # fmt: skip
        snapshot = cast(RingSnapshot, taken)
        copies: dict[int, torch.Tensor] = {}
        for name, param in model.named_parameters():
            copies[id(param)] = snapshot.params[name]
        for name, buffer in model.named_buffers():
            copies[id(buffer)] = snapshot.buffers[name]
        for name, tensor in model.state_dict(keep_vars=True).items():
            copy = copies.get(id(tensor))
            if copy is None:
                copy = tensor.detach().to("cpu", copy=True)
                snapshot.built += copy.numel() * copy.element_size()
            snapshot.model_state[name] = copy
        return snapshot

    @property
    def nbytes(self) -> int:
        return super().nbytes + self.built
