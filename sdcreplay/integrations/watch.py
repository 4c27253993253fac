"""What both trainer callbacks do, without either framework.

A trainer runs its own step, so no detector can drive it (nor roll it back and
recompute it): the callbacks *observe* each step instead. ``StepWatch`` opens a
ring ``Recorder`` step when the framework hands over the batch, notes the
gradient norms before the step's clipping (``online.pre_clip``; else just before
the optimizer's update) and a copy of the parameters where the detector judges
updates (``when="after_update"``), and when the step
ends gives ``UpdateDetector.judge`` what it saw. On an alarm the detector dumps
the ring (the alarmed step is its last one) and the callback stops training
(``stop_on_alarm``). A failure of the callback's own never reaches the trainer's
loop: it is warned about and the callback stops watching
(``WatchOptions.guarded``); training goes on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..capture.layers import grads_entering
from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot
from ..errors import SdcReplayError, message_of
from ..kinds import SignatureLevel
from ..online.alarms import Alarm, Observation, observe
from ..online.pre_clip import PreClipNorms
from ..online.update_detector import UpdateDetector
from ..recording.recorder import Recorder


class _StepAbandoned(Exception):
    """Thrown into a step the framework never ended (it raised between two callbacks)."""


class StepWatch:
    """A ring Recorder around each step a framework runs, and an UpdateDetector judging it.

    ``workload`` (with ``workload_kwargs``) is what replay calls to rebuild the model,
    optimizer and a ``train_step`` equal to the trainer's (docs/online.md, "Callbacks");
    ``ring`` the steps kept; ``detector`` keyword arguments of ``UpdateDetector``.
    """

    def __init__(
        self,
        path: str | Path,
        workload: str,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        workload_kwargs: dict | None = None,
        state: Mapping[str, Any] | None = None,
        ring: int = 8,
        detector: Mapping[str, Any] | None = None,
        verify: bool | str = True,
        start_step: int = 0,
        signature: SignatureLevel = "layer",
        max_window: int = 1000,
    ):
        self.model, self.optimizer = model, optimizer
        self.recorder = Recorder(
            path,
            workload,
            model,
            optimizer,
            state=state,
            workload_kwargs=workload_kwargs,
            ring=ring,
            verify=verify,
            start_step=start_step,
            signature=signature,
            max_window=max_window,
        )
        self.detector = UpdateDetector(
            model=model,
            optimizer=optimizer,
            recorder=self.recorder,
            **dict(detector or {}),
        )
        self.step_index = start_step
        self._pre_clip = PreClipNorms(model, optimizer)
        self._open: contextlib.AbstractContextManager | None = None
        self._losses: list[torch.Tensor] = []
        self._grad_norms: dict[str, float] = {}
        self._before: TrainingSnapshot | None = None
        self._reached_optimizer = False

    @property
    def alarms(self) -> list[Alarm]:
        return self.detector.alarms

    @property
    def in_step(self) -> bool:
        return self._open is not None

    def begin(self, batch: Any, *, clear_grads: bool = False) -> None:
        """The step starts with ``batch`` (as the model receives it); ``clear_grads``: drop the
        previous step's gradients first (a framework that zeroes them only before backward)."""
        self._abandon_open_step()
        if clear_grads and grads_entering(self.model) != "none":
            self.optimizer.zero_grad(set_to_none=True)
        self._losses, self._grad_norms, self._before = [], {}, None
        self._reached_optimizer = False
        self._pre_clip.begin()
        step = self.recorder.step(batch)
        step.__enter__()
        self._open = step

    def extend(self, micro_batch: Any) -> None:
        """Another micro-batch of the open step (its forward begins)."""
        self.recorder.extend_batch(micro_batch)

    def saw_loss(self, loss: Any) -> None:
        """A micro-batch's loss: the step's is their mean, as trainers log it."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            self._losses.append(loss.detach().reshape(()))

    def before_optimizer(self) -> None:
        """The gradients' norms before the step's first clip or unscale (``PreClipNorms``:
        a trainer clips before it tells callbacks the optimizer steps); the parameters before
        its update only where the detector judges the update (``when="after_update"``: a
        copy)."""
        self._grad_norms = self._pre_clip.take()
        self._reached_optimizer = True
        if self.detector.when == "after_update":
            with _own_work():
                self._before = TrainingSnapshot.take(self.model, None, {}, grads=False, rng=False)

    def end(self) -> Alarm | None:
        """The step ended: record it, then judge it (an alarm dumps the ring first)."""
        step, self._open = self._open, None
        if step is None:
            return None
        step.__exit__(None, None, None)
        index, self.step_index = self.step_index, self.step_index + 1
        if not self._reached_optimizer:  # the optimizer did not step: nothing to judge
            return None
        loss = torch.stack(self._losses).mean() if self._losses else None
        if self._before is not None:
            seen = observe(self.model, self._before, loss, self._grad_norms)
        else:
            seen = Observation(None if loss is None else float(loss), self._grad_norms, {})
        self._before, self._reached_optimizer = None, False
        alarm = self.detector.judge(seen, step=index)
        if alarm is not None:
            warnings.warn(f"sdcreplay: {alarm.describe()}", stacklevel=2)
        return alarm

    def checkpoint_saved(self, path: str | Path, *, clear_grads: bool = False) -> None:
        """The trainer just saved a checkpoint at ``path``: the ring's window starts there
        (``Recorder.checkpoint_saved``); ``clear_grads``: drop the last step's gradients first
        (a framework whose next step drops them anyway, as ``begin`` does). A checkpoint the
        ring cannot anchor on is warned about, never raised out of training: the ring goes on
        copying the state."""
        if clear_grads and grads_entering(self.model) != "none":
            self.optimizer.zero_grad(set_to_none=True)
        try:
            self.recorder.checkpoint_saved(path)
        except SdcReplayError as exc:
            warnings.warn(f"sdcreplay: {exc.message} ({exc.hint})", stacklevel=2)

    def _abandon_open_step(self) -> None:
        """A step the framework began but never ended (an exception between two callbacks) is
        no evidence: the Recorder discards it at the next step."""
        step, self._open = self._open, None
        if step is not None:
            step.__exit__(_StepAbandoned, _StepAbandoned(), None)

    def close(self) -> None:
        self._abandon_open_step()
        self._pre_clip.close()
        self.detector.close()
        self.recorder.close()


class WatchOptions:
    """What both callbacks take, and the StepWatch they start with it once the trainer has
    built its model and optimizer.

    ``path``: where an alarm's bundle goes; ``workload`` and ``workload_kwargs`` name the
    factory replay calls (docs/online.md, "Callbacks"); ``ring``: steps kept; ``detector``:
    ``UpdateDetector`` keyword arguments; ``stop_on_alarm``: stop training after an alarm;
    ``signature`` and ``max_window``: the Recorder's (the window since the trainer's last
    checkpoint, which the callbacks announce from the trainer's own save). ``alarms`` lists
    the alarms, each with its bundle; ``failure`` says why the callback stopped watching
    (None while it watches).
    """

    def __init__(
        self,
        path: str | Path,
        workload: str,
        *,
        workload_kwargs: dict | None = None,
        ring: int = 8,
        detector: Mapping[str, Any] | None = None,
        stop_on_alarm: bool = True,
        verify: bool | str = True,
        signature: SignatureLevel = "layer",
        max_window: int = 1000,
    ):
        self.path, self.workload = Path(path), workload
        self.workload_kwargs = dict(workload_kwargs or {})
        self.ring, self.detector = ring, dict(detector or {})
        self.stop_on_alarm, self.verify = stop_on_alarm, verify
        self.signature, self.max_window = signature, max_window
        self.watch: StepWatch | None = None
        self.failure: str | None = None

    @property
    def alarms(self) -> list[Alarm]:
        return [] if self.watch is None else self.watch.alarms

    @property
    def watching(self) -> bool:
        return self.watch is not None and self.failure is None

    @contextlib.contextmanager
    def guarded(self, event: str) -> Iterator[None]:
        """The callback's work in one of the trainer's events: what fails there is the
        callback's own failure, never the training's, so it is warned about, the callback
        stops watching (what the ring holds is dropped), and training goes on."""
        try:
            yield
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {message_of(exc)}"
            written = ", ".join(alarm.bundle for alarm in self.alarms if alarm.bundle)
            warnings.warn(
                f"sdcreplay: {type(self).__name__} failed in {event} ({self.failure}); it "
                "stops watching and training goes on unwatched"
                + (f" (bundles written before: {written})" if written else ""),
                stacklevel=3,
            )
            with contextlib.suppress(Exception):
                self.stop_watching()

    def stop_watching(self) -> None:
        """Let go of the model: the watch's hooks, recorder and detector."""
        if self.watch is not None:
            self.watch.close()

    def start_watch(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        state: Mapping[str, Any] | None = None,
        start_step: int = 0,
    ) -> StepWatch:
        self.watch = StepWatch(
            self.path,
            self.workload,
            model,
            optimizer,
            workload_kwargs=self.workload_kwargs,
            state=state,
            ring=self.ring,
            detector=self.detector,
            verify=self.verify,
            start_step=start_step,
            signature=self.signature,
            max_window=self.max_window,
        )
        return self.watch
