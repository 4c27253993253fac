"""How the update detector runs the loop's step and takes it back.

Two ways, one interface (``begin``, ``run``, ``rollback``, ``snapshot``):

- ``BeforeUpdate`` (the default, no copy): the step is judged at the optimizer's step, on
  what is already there (the loss handed to backward, each gradient's norm), and an alarmed
  execution is stopped there, before anything is updated. Taking it back discards its
  gradients (in place: they entered the step as None or zeros) and puts back what a forward
  and backward may change (RNG states, buffers, state objects), so a recompute re-runs the
  forward and backward from the unchanged parameters.
- ``AfterUpdate`` (``when="after_update"``): a copy of the state (parameters, optimizer,
  state objects, gradients, RNG) before every step, the step run through its update, judged
  on the update's norms, and restored from the copy.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from ..capture.layers import grads_entering
from ..capture.module_names import named_parameters
from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot
from ..errors import SdcReplayError
from ..workload.definition import Workload
from .alarms import (
    BackwardLosses,
    Observation,
    Sketch,
    gradient_result,
    learning_rates,
    observe,
    sketch_distances,
    update_sketch,
)
from .pre_clip import PreClipNorms
from .replay_check import _Baseline, _weakly

Decide = Callable[[Observation], bool]
"""Given an execution's observation: let it go on (True), or stop it before the update."""


class _Stopped(Exception):
    """An execution the detector stopped at the optimizer's step, before the update."""


@dataclass
class Execution:
    """What one execution of the step gave: its loss (as the step returned it, where something
    returned one), what the detector saw, whether it went through its update."""

    loss: Any = None
    seen: Observation | None = None
    went_through: bool = False


class BeforeUpdate:
    """Runs the step up to the optimizer's step, judges it there, stops it when told to.

    Its optimizer hook is global (``register_optimizer_step_pre_hook``), so it runs before the
    optimizer's own hooks: an execution it stops has not reached a fault injector's dispatch
    mode's optimizer phase nor a Recorder's capture, which it tells itself (the Recorder
    holds the step as stopped before its optimizer step, with what the optimizer was given).
    """

    keeps_alarmed_execution = False  # an alarmed execution was stopped, never applied

    def __init__(self, workload: Workload):
        self.workload = workload
        self._baseline: _Baseline | None = None
        self._losses = BackwardLosses(workload.state)
        self._decide: Decide | None = None
        self._recorder: Any = None
        self._recompute = False
        self._seen: Observation | None = None
        self._sketch: Sketch | None = None  # after the last update
        # the model's parameters, named once: a step walks the module tree no more
        self._named = list(named_parameters(workload.model))
        self._norms = PreClipNorms(workload.model, workload.optimizer, self._named)
        self._hooks = [
            register_optimizer_step_pre_hook(_weakly(self._optimizer_begins)),
            register_optimizer_step_post_hook(_weakly(self._optimizer_ended)),
        ]
        for hook in self._hooks:
            weakref.finalize(self, hook.remove)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._norms.close()

    def begin(self, step: int) -> None:
        """The step starts: note what its forward and backward may change (nothing is copied
        that the step does not change: parameters and optimizer state stay where they are)."""
        model = self.workload.model
        if grads_entering(model) == "kept":
            raise SdcReplayError(
                f"step {step} begins with gradients accumulated before it: judged before its "
                "update, an alarmed step is taken back by discarding its gradients, which would "
                "lose them",
                "Give the detector whole optimizer steps (zero_grad before the step), or build "
                "it with when='after_update' (a copy of the state before every step).",
            )
        self._baseline = _Baseline(model, self.workload.state, {})

    def run(
        self, batch: Any, decide: Decide, *, recompute: bool, recorder: Any = None
    ) -> tuple[Any, Observation, bool]:
        """The step, judged by ``decide`` at the optimizer's step (or at its end, without one):
        (loss, observation, whether it went through). ``recompute``: note the result a
        recompute must reproduce; ``recorder``: the Recorder whose step this execution is."""
        with self.watching(decide, recompute=recompute, recorder=recorder) as execution:
            execution.loss = self.workload.run_step(batch)
        assert execution.seen is not None
        return execution.loss, execution.seen, execution.went_through

    @contextlib.contextmanager
    def watching(
        self, decide: Decide, *, recompute: bool = False, recorder: Any = None
    ) -> Iterator[Execution]:
        """One execution of the step, whatever runs it (``run``, or an inline loop's block):
        judged by ``decide`` at the optimizer's step, stopped there when it says so (the
        exception ends the block here), else judged as the block ends."""
        execution = Execution()
        self._decide, self._recorder, self._recompute, self._seen = (
            decide,
            recorder,
            recompute,
            None,
        )
        self._norms.begin()
        try:
            with self._losses.observing():
                yield execution
        except _Stopped:
            assert self._seen is not None
            execution.seen, execution.loss = self._seen, None
            return
        finally:
            self._decide, self._recorder = None, None
        if self._seen is not None:  # judged at the optimizer's step, and let through
            execution.seen, execution.went_through = self._seen, True
            return
        execution.seen = seen = self._observe(execution.loss)  # no optimizer step: judged now
        execution.went_through = self._judged(seen, decide)

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        decide = self._decide
        if decide is None or optimizer is not self.workload.optimizer or self._seen is not None:
            return
        seen = self._seen = self._observe(None)
        if self._judged(seen, decide):
            return
        if self._recorder is not None:
            self._recorder.stop_before_optimizer()
        raise _Stopped

    def _optimizer_ended(self, optimizer, args, kwargs) -> None:
        """The update went through: its norms, measured on a sketch (each parameter's rows'
        sums against those after the previous update; one pass, no copy) and divided by the
        learning rate it was made with (a schedule's warm-up or decay is no anomaly). The
        scheduler steps after the optimizer, so the groups still hold that rate here."""
        seen = self._seen
        if seen is None or optimizer is not self.workload.optimizer or seen.update_norms:
            return
        sketch = update_sketch(self._named)
        if self._sketch is not None:
            rates = learning_rates(optimizer, self._named)
            seen.update_norms = {
                name: norm / rates[name]
                for name, norm in sketch_distances(self._sketch, sketch).items()
                if rates.get(name)
            }
        self._sketch = sketch

    def _judged(self, seen: Observation, decide: Decide) -> bool:
        """``decide``'s word; an execution it stops keeps the result a recompute must repeat."""
        if decide(seen):
            return True
        if not seen.result:
            seen.result = gradient_result(self.workload.model, self._losses.tensor())
        return False

    def _observe(self, returned: Any) -> Observation:
        model = self.workload.model
        loss = self._losses.tensor()
        if loss is None and isinstance(returned, torch.Tensor):
            loss = returned.detach()
        seen = Observation(None if loss is None else float(loss), self._norms.take(), {}, result=())
        if self._recompute:
            seen.result = gradient_result(model, loss)
        return seen

    def rollback(self) -> None:
        """Back to how the step began: gradients discarded, RNG, buffers, state objects put
        back; the parameters and the optimizer were never touched."""
        assert self._baseline is not None
        self._baseline.restore()

    def snapshot(self) -> TrainingSnapshot:
        """The state before the step, for a second opinion (copied now: on an alarm only)."""
        self.rollback()
        with _own_work():
            return TrainingSnapshot.take(
                self.workload.model, self.workload.optimizer, self.workload.state, grads=False
            )


class AfterUpdate:
    """Runs the step through its update and judges the update; a copy of the state taken
    before every step (``snapshot_device``: where it is kept) takes it back."""

    keeps_alarmed_execution = True  # the alarmed execution was applied (and recorded)

    def __init__(self, workload: Workload, snapshot_device: torch.device | str | None):
        self.workload = workload
        self.snapshot_device = snapshot_device
        self._before: TrainingSnapshot | None = None
        self._grad_norms: dict[str, float] | None = None
        self._losses = BackwardLosses(workload.state)
        self._norms = PreClipNorms(workload.model, workload.optimizer)
        self._hook = workload.optimizer.register_step_pre_hook(self._optimizer_begins)

    def close(self) -> None:
        self._hook.remove()
        self._norms.close()

    def begin(self, step: int) -> None:
        with _own_work():
            self._before = TrainingSnapshot.take(
                self.workload.model,
                self.workload.optimizer,
                self.workload.state,
                device=self.snapshot_device,
            )

    def run(
        self, batch: Any, decide: Decide, *, recompute: bool, recorder: Any = None
    ) -> tuple[Any, Observation, bool]:
        """The whole step, then ``decide`` told what it did (the update is applied either
        way: ``rollback`` takes it back)."""
        with self.watching(decide) as execution:
            execution.loss = self.workload.run_step(batch)
        assert execution.seen is not None
        return execution.loss, execution.seen, True

    @contextlib.contextmanager
    def watching(
        self, decide: Decide, *, recompute: bool = False, recorder: Any = None
    ) -> Iterator[Execution]:
        """One execution of the step, whatever runs it, judged once it applied its update
        (the loss: the one it returned, else those handed to backward)."""
        assert self._before is not None
        execution = Execution(went_through=True)
        self._grad_norms = {}
        self._norms.begin()
        try:
            with self._losses.observing():
                yield execution
            grad_norms = self._grad_norms
        finally:
            self._grad_norms = None
        loss = execution.loss
        if not isinstance(loss, torch.Tensor):
            loss = self._losses.tensor()
        execution.seen = observe(self.workload.model, self._before, loss, grad_norms)
        decide(execution.seen)

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        if self._grad_norms is None or self._grad_norms:
            return
        self._grad_norms.update(self._norms.take())

    def rollback(self) -> None:
        assert self._before is not None
        with _own_work():
            self._before.restore()

    def snapshot(self) -> TrainingSnapshot:
        assert self._before is not None
        return self._before
