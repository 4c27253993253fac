"""A second device's opinion on an alarmed step (Megatron's rerun on another GPU).

A result that reproduces bit for bit on one device may still be that device's
fault: recomputing the step elsewhere from the same state tells a correct step
from a persistent fault.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..capture.determinism import capture_rng, restore_rng
from ..capture.snapshot import TrainingSnapshot, copy_state
from ..storage.tensorio import map_tensors
from ..workload.definition import Workload
from .alarms import Alarm, BackwardLosses, Observation, gradient_norms, observe

SecondOpinion = Callable[[Alarm, TrainingSnapshot, Any], bool]
"""``(alarm, snapshot before the step, batch) -> True`` when another device, from the same
state, reproduces the alarmed result (so it was correct)."""


class ReplicaOpinion:
    """Megatron's rerun on a different GPU: a second copy of the workload on ``device``
    recomputes the alarmed step from the same state, in its own thread (so no dispatch mode
    of the training thread, where injected faults live, reaches it).

    ``make_workload`` builds the same workload (e.g. ``lambda: build_workload(ref, kwargs)``);
    it is built once, on first use. The alarmed result is confirmed (``correct``) when the
    replica's loss and every gradient and update norm the alarm was judged on agree within
    ``rtol`` (devices round differently).
    """

    def __init__(
        self, make_workload: Callable[[], Workload], device: str = "cpu", rtol: float = 1e-3
    ):
        self.make_workload, self.device, self.rtol = make_workload, torch.device(device), rtol
        self._replica: Workload | None = None
        self.last: Observation | None = None

    def __call__(self, alarm: Alarm, before: TrainingSnapshot, batch: Any) -> bool:
        outcome: list[Any] = []
        worker = threading.Thread(target=self._recompute, args=(before, batch, outcome))
        saved = capture_rng(before.device)
        try:
            worker.start()
            worker.join()
        finally:
            restore_rng(saved, before.device)
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        before_update, after_update = outcome[0]
        original = alarm.original
        assert original is not None
        # judged after the update: on the loss the step returned; before it: on the losses
        # handed to backward (update_steps.BackwardLosses)
        seen = self.last = after_update if original.update_norms else before_update
        return (
            self._close(seen.loss, original.loss)
            and all(
                self._close(seen.grad_norms.get(name), norm)
                for name, norm in original.grad_norms.items()
            )
            and all(
                self._close(seen.update_norms.get(name), norm)
                for name, norm in original.update_norms.items()
            )
        )

    def _close(self, a: float | None, b: float | None) -> bool:
        if a is None or b is None:
            return a is b
        return a == b or math.isclose(a, b, rel_tol=self.rtol)

    def _recompute(self, before: TrainingSnapshot, batch: Any, outcome: list) -> None:
        try:
            if self._replica is None:
                self._replica = self.make_workload()
                self._replica.model.to(self.device)
            replica = self._replica
            load_snapshot(replica, before)
            if before.rng is not None:
                restore_rng(before.rng, self.device)
            moved = map_tensors(batch, lambda t: t.to(self.device))
            state = TrainingSnapshot.take(replica.model, None, grads=False, rng=False)
            losses = BackwardLosses(replica.state)
            norms: dict[str, float] = {}

            def optimizer_begins(optimizer, args, kwargs) -> None:
                norms.update({} if norms else gradient_norms(replica.model))

            hook = replica.optimizer.register_step_pre_hook(optimizer_begins)
            try:
                with losses.observing():
                    loss = replica.run_step(moved)
            finally:
                hook.remove()
            before_update = Observation(losses.value(), norms, {})
            outcome.append((before_update, observe(replica.model, state, loss, norms)))
        except BaseException as exc:  # handed to the training thread
            outcome.append(exc)


def load_snapshot(workload: Workload, snapshot: TrainingSnapshot) -> None:
    """Put a snapshot of one copy of a workload into another copy (same factory: same names
    and parameter order)."""
    params = dict(workload.model.named_parameters())
    buffers = dict(workload.model.named_buffers())
    with torch.no_grad():
        for name, value in snapshot.params.items():
            params[name].copy_(value)
        for name, value in snapshot.buffers.items():
            buffers[name].copy_(value)
    for param in params.values():
        param.grad = None
    if snapshot.optimizer_state is not None:
        workload.optimizer.load_state_dict(copy_state(snapshot.optimizer_state))
    for name, obj in workload.state.items():
        obj.load_state_dict(copy_state(snapshot.object_states[name]))
