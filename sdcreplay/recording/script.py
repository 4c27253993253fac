"""Script mode, the recording's side: what a Recorder given no ``workload=`` keeps, and the
Recorder a script gets when it runs in replay mode.

Recording, a step's batch is the list of inputs the loop fed it (``rec.step(batch)``'s batch
first, then each ``rec.feed(obj)``), and the step keeps what the loop set around it
(capture/around.py): each param group's hyperparameters as it began, the torch RNG at each
feed and each entry of the model's forward. Replaying (replay/script.py), the same script
builds its objects and calls the same methods; ``ReplayingRecorder`` hands the objects to the
replay and runs each step's body inside the block the replay hands it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..capture.around import RestorePoints, hyperparameters
from ..errors import SdcReplayError
from ..replay.script import Handoff, LoopObjects, StepFeeds
from ..storage.tensorio import map_tensors


def stored(batch: Any) -> Any:
    """The recorder's own CPU copy: the loop may reuse or change its batch afterwards."""
    return map_tensors(batch, lambda t: t.detach().to("cpu", copy=True))


class AroundSteps:
    """What the loop sets around each recorded step: hyperparameters at its entry (every
    Recorder) and, in script mode, the inputs it feeds and the RNG at each restore point."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, script: bool):
        self.optimizer = optimizer
        self.script = script
        self._points = RestorePoints(next(model.parameters()).device, model) if script else None
        self._hyper: list[dict] = []
        self.feeds: list[Any] | None = None  # the open step's, in script mode

    def begin(self) -> None:
        self._hyper = hyperparameters(self.optimizer)
        if self._points is not None:
            self._points.begin_recording()
            self.feeds = []

    def feed(self, obj: Any) -> None:
        if self.feeds is None:
            raise SdcReplayError(
                "rec.feed() records an input of an open step of a script-mode Recorder",
                "Call it inside `with rec.step():` of a Recorder given no workload=.",
            )
        self.feeds.append(stored(obj))
        assert self._points is not None
        self._points.at_point("a rec.feed")

    def end(self) -> tuple[list[Any] | None, dict]:
        """The step's fed inputs (script mode, else None) and what ``around`` keeps."""
        around: dict[str, Any] = {"hyper": self._hyper}
        feeds, self.feeds = self.feeds, None
        if self._points is not None:
            around["rng"] = self._points.end()
        return feeds, around

    def close(self) -> None:
        if self._points is not None:
            self._points.close()


class ReplayingRecorder:
    """What ``sdcreplay.Recorder(...)`` is in a script replayed in replay mode: it hands the
    loop's objects to the replay, and each ``step()`` runs its body in the replay's block of
    the next recorded step, ``feed()`` returning the recorded inputs. Writes nothing."""

    def __init__(
        self,
        handoff: Handoff,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any] | None,
        data_parallel: torch.nn.Module | None,
    ):
        self._handoff = handoff
        self._feeds: StepFeeds | None = None
        self.model, self.optimizer = model, optimizer
        handoff.offer(LoopObjects(model, optimizer, dict(state or {}), data_parallel))

    @contextlib.contextmanager
    def step(self, batch: Any = None) -> Iterator[Any]:
        block = self._handoff.next_block()
        with block as feeds:
            self._feeds = feeds
            try:
                yield batch if batch is None else self.feed(batch)
            finally:
                self._feeds = None

    def feed(self, obj: Any) -> Any:
        if self._feeds is None:
            raise SdcReplayError(
                "rec.feed() was called outside a step", "Call it inside `with rec.step():`."
            )
        return self._feeds.next()

    def checkpoint_saved(self, *args: Any, **kwargs: Any) -> None:
        """A replay announces no checkpoint: the loop's own save is its business (guarded)."""

    def close(self) -> None:
        """A replayed script ends at its next step once the replay has its steps; a loop that
        closes its Recorder first ends here. One that closes it as an error unwinds (a
        trainer's ``close()`` in its ``except``) lets the error end the script: it is the
        replay's to report, not a parked script's."""
        if sys.exc_info()[1] is not None:
            return
        self._handoff.next_block()
        raise SdcReplayError("a replayed script went on after its Recorder was closed")

    def abandon(self) -> None:
        """Nothing was written."""

    def __enter__(self) -> ReplayingRecorder:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        if exc_type is None:
            self.close()
