"""The update detector: alarms on unusual gradients and updates inside training.

``UpdateDetector`` judges each step on statistics the optimizer's step already has at hand
(the loss, each gradient's norm against its EMA, NaN/Inf, Megatron's loss and gradient-norm
spikes) and, on an alarm, recomputes it and classifies the alarm as Megatron's rerun state
machine does. By default it judges before the optimizer's update and copies nothing: an
alarmed step is stopped before anything is updated and recomputed from the unchanged
parameters (``update_steps.BeforeUpdate``); ``when="after_update"`` judges the update's norms
instead, from a copy of the state before every step. It drives the loop's own step and,
given a ring ``Recorder``, records every step through it and dumps a bundle when an alarm
needs evidence. See docs/online.md.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import torch

from ..errors import SdcReplayError
from ..ledger.notes import note
from ..ledger.verdicts import alarm_record
from ..replay.script import replaying
from ..workload.definition import Workload
from .agreement import _highest
from .alarms import Alarm, Classification, Observation, summarize_reasons
from .baselines import Baselines, Thresholds
from .second_opinion import SecondOpinion
from .step import ConfigurationError, step_workload
from .stopping import NonFiniteResultError, PersistentFaultError, RecomputeLimitError
from .update_steps import AfterUpdate, BeforeUpdate, Decide

PEER_ALARM = "peer"
"""The reason on a rank that raised no alarm itself but rolls back with one that did."""

When = Literal["before_update", "after_update"]

# What a recompute showed, ordered so that the largest over the ranks decides for all.
_PASSED, _REPEATED, _OTHER = 0, 1, 2


def _go_on(seen: Observation) -> bool:
    return True


class UpdateDetector:
    """Runs the loop's step and alarms on unusual gradients and updates; recomputes an alarm.

    The rules (``baselines.Baselines``; seeds/001 and Megatron's rerun state machine):
    ``nonfinite:loss``, ``nonfinite:grad:NAME``, ``nonfinite:update:NAME``; ``loss_spike`` /
    ``grad_spike``: the loss / global gradient norm above ``spike_factor`` x the largest of
    the first ``spike_steps`` steps; after ``warmup`` accepted steps, ``grad:NAME``: a
    gradient's norm above both ``jump_factor`` x its EMA and its EMA + ``jump_sigmas`` x the
    spread of its last ``window`` accepted norms; ``update:NAME``: the parameter's update
    norm off its EMA by more than ``max(alpha * EMA, sigmas * spread)``.

    ``when="before_update"`` (the default) judges the loss and gradients at the optimizer's
    step and copies nothing: an alarmed execution is stopped before the update and taken back
    by discarding its gradients (the step must begin with none pending, as after
    ``zero_grad``). Its update is judged once applied, on a sketch (rows' and columns' sums
    per learning rate, ``jump_sigmas`` for the spread): such an alarm cannot be recomputed
    and is left unresolved (dumped, warned about; training goes on). ``when="after_update"``
    copies the state before every step (``snapshot_device``: where), judges the update's own
    norm and restores the copy to recompute.

    An alarmed step is recomputed on the same device. A different result is ``transient``
    (the recompute is kept once it passes); the same result is reproducible: ``correct``
    when ``second_opinion`` confirms it elsewhere, ``persistent`` when it does not (the
    step is taken back and ``PersistentFaultError`` raised). Without a second opinion a
    reproducible alarm is ``correct``, unless the last ``persistent_after`` steps all ended
    in reproducible alarms: then ``persistent``. Under torch.distributed the ranks of
    ``group`` agree on every decision, so they run the same executions.
    """

    def __init__(
        self,
        workload: Workload | None = None,
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        train_step: Callable[[Any], torch.Tensor | None] | None = None,
        loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor] | None = None,
        state: Mapping[str, Any] | None = None,
        when: When = "before_update",
        alpha: float = 0.05,
        sigmas: float = 3.0,
        ema_decay: float = 0.9,
        window: int = 100,
        warmup: int = 10,
        spike_factor: float = 10.0,
        spike_steps: int = 100,
        jump_factor: float = 4.0,
        jump_sigmas: float = 6.0,
        max_recomputes: int = 3,
        persistent_after: int = 3,
        second_opinion: SecondOpinion | None = None,
        snapshot_device: torch.device | str | None = None,
        recorder: Any = None,
        start_step: int = 0,
        group: Any = None,
        ledger: bool = True,
    ):
        thresholds = Thresholds(
            alpha, sigmas, ema_decay, window, warmup, spike_factor, spike_steps, jump_factor,
            jump_sigmas,
        )  # fmt: skip
        if max_recomputes < 1 or persistent_after < 1:
            raise SdcReplayError("max_recomputes and persistent_after must be at least 1")
        if when not in ("before_update", "after_update"):
            raise SdcReplayError(
                f"when={when!r} is not a moment to judge a step",
                "Pass when='before_update' (the default: no copy) or 'after_update' (a copy "
                "of the state before every step, the update's norms judged).",
            )
        self.workload = step_workload(
            workload, model, optimizer, train_step, loss_fn, state, "UpdateDetector", inline=True
        )
        self.when = when
        self.thresholds = thresholds
        self.max_recomputes, self.persistent_after = max_recomputes, persistent_after
        self.second_opinion = second_opinion
        self.group = group
        self.ledger = ledger  # append transient and persistent alarms to the device ledger
        self.recorder = recorder
        self.next_step = start_step
        self.alarms: list[Alarm] = []
        self._baselines = Baselines(thresholds, exact_updates=when == "after_update")
        self._steps: BeforeUpdate | AfterUpdate = (
            BeforeUpdate(self.workload)
            if when == "before_update"
            else AfterUpdate(self.workload, snapshot_device)
        )
        self._reproducible_in_a_row = 0
        self._counts: Counter[str] = Counter()
        self._overhead = 0.0
        self._recompute_seconds = 0.0
        self._step_seconds = 0.0

    def close(self) -> None:
        """Remove the optimizer hook."""
        self._steps.close()

    def __enter__(self) -> UpdateDetector:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def metrics(self) -> dict[str, float | int]:
        """Counters to log: ``steps``, ``detections`` (alarms raised), ``recomputes``,
        ``correct``/``transient``/``persistent`` (classifications), ``overhead_ms`` (time
        spent detecting and recomputing, all steps), ``recompute_ms`` (its recompute part)."""
        return {
            "steps": self._counts["steps"],
            "detections": self._counts["detections"],
            "recomputes": self._counts["recomputes"],
            "correct": self._counts["correct"],
            "transient": self._counts["transient"],
            "persistent": self._counts["persistent"],
            "overhead_ms": 1000.0 * self._overhead,
            "recompute_ms": 1000.0 * self._recompute_seconds,
        }

    @property
    def last_alarm(self) -> Alarm | None:
        return self.alarms[-1] if self.alarms else None

    def run_step(self, batch: Any, *, step: int | None = None) -> torch.Tensor | None:
        """One training step, checked; returns the loss of the execution kept."""
        step = self.next_step if step is None else step
        self.next_step = step + 1
        self._counts["steps"] += 1
        started, step_seconds = time.perf_counter(), 0.0
        try:
            self._steps.begin(step)
            reasons: list[str] = []

            def decide(seen: Observation) -> bool:
                found = self.reasons(seen)
                alarmed = bool(_highest(int(bool(found)), self.group))  # the same on every rank
                reasons[:] = (found or [PEER_ALARM]) if alarmed else []
                return not alarmed

            recording = self.recorder.step(batch) if self.recorder is not None else None
            with recording if recording is not None else contextlib.nullcontext():
                loss, original, _ = self._execute(batch, decide, recording=True)
            step_seconds = self._step_seconds
            if not reasons and self.when == "before_update":
                late = self._baselines.reasons_of_update(original)  # the update is applied
                if _highest(int(bool(late)), self.group):
                    return self._unresolved(step, late or [PEER_ALARM], original, loss)
            if not reasons:
                self._reproducible_in_a_row = 0
                self._baselines.accept(original)
                return loss
            self._counts["detections"] += 1
            alarm = Alarm(step, list(reasons), original=original)
            self.alarms.append(alarm)
            return self._resolve(batch, alarm)
        finally:  # everything but the loop's own step (the first execution) is overhead
            self._overhead += time.perf_counter() - started - step_seconds

    def _unresolved(
        self, step: int, reasons: list[str], seen: Observation, loss: Any
    ) -> torch.Tensor | None:
        """An unusual update seen once applied (judged before the update, nothing was copied
        to take it back): an alarm left unresolved, the ring dumped with the step as its last
        (a replay elsewhere tells a fault from a genuine update), a warning; training goes on
        (the loop may stop on ``last_alarm``). Its update norms join no baseline."""
        self._counts["detections"] += 1
        alarm = Alarm(step, reasons, original=seen)
        self.alarms.append(alarm)
        if self.recorder is not None:
            self._dump(alarm)
        warnings.warn(
            f"sdcreplay: {alarm.describe()}: the update was applied; judged before updates, "
            "the detector keeps no copy to take it back",
            stacklevel=3,
        )
        self._baselines.accept(Observation(seen.loss, seen.grad_norms, {}))
        return loss

    @contextlib.contextmanager
    def step(self, batch: Any = None, *, step: int | None = None) -> Iterator[Any]:
        """One step of an inline loop, judged: ``with detector.step():`` where the loop had
        ``with rec.step():`` (it opens the recorder's step itself and yields what that yields).
        The block runs once and its update is applied: what it handed to ``backward()``, the
        gradient norms before its first clip and its update are judged as it ends (with the
        ranks' agreement); an alarm dumps the ring (the step its last), is warned about and
        is ``last_alarm``; training goes on. In a replay of the script, just the recorder's
        step."""
        recording = self.recorder.step(batch) if self.recorder is not None else None
        if replaying():
            with recording if recording is not None else contextlib.nullcontext(batch) as given:
                yield given
            return
        if getattr(self.recorder, "_in_block", False):
            raise ConfigurationError(
                "detector.step() inside the recorder's open step: the detector opens it itself "
                "and judges the step once it is recorded",
                "Replace `with rec.step():` by `with detector.step():` (not both).",
            )
        index = self.next_step if step is None else step
        if self.when == "after_update":
            self._steps.begin(index)  # the copy the update is measured against
        with recording if recording is not None else contextlib.nullcontext(batch) as given:
            with self._steps.watching(_go_on) as execution:
                yield given
        started = time.perf_counter()
        try:
            assert execution.seen is not None
            alarm = self.judge(execution.seen, step=index)
            if alarm is not None:
                warnings.warn(
                    f"sdcreplay: {alarm.describe()}: the update was applied (an inline step "
                    "runs once); replay the bundle on other devices to tell a fault from a "
                    "genuine update",
                    stacklevel=3,
                )
        finally:
            self._overhead += time.perf_counter() - started

    def judge(self, seen: Observation, *, step: int) -> Alarm | None:
        """Judge a step the detector did not run (an inline loop's, a Trainer callback's),
        agreed by the ranks: a clean one joins the baselines; an alarm is dumped (with a
        recorder), neither rolled back nor recomputed."""
        self._counts["steps"] += 1
        self.next_step = step + 1
        reasons = self.reasons(seen)
        if not _highest(int(bool(reasons)), self.group):  # the same on every rank
            self._baselines.accept(seen)
            return None
        self._counts["detections"] += 1
        alarm = Alarm(step, reasons or [PEER_ALARM], original=seen)
        self.alarms.append(alarm)
        if self.recorder is not None:
            self._dump(alarm)
        return alarm

    def reasons(self, seen: Observation) -> list[str]:
        """Why ``seen`` is unusual against the baselines (empty: it is not)."""
        return self._baselines.reasons(seen)

    def _execute(
        self, batch: Any, decide: Decide, *, recompute: bool = False, recording: bool = False
    ) -> tuple[Any, Observation, bool]:
        started = time.perf_counter()
        try:
            return self._steps.run(
                batch,
                decide,
                recompute=recompute,
                recorder=self.recorder if recording else None,
            )
        finally:
            self._step_seconds = time.perf_counter() - started

    def _resolve(self, batch: Any, alarm: Alarm) -> torch.Tensor | None:
        """Recompute until every rank's execution passes (transient, or correct on a rank that
        only followed another's alarm), or one repeats its predecessor (reproducible), at most
        ``max_recomputes`` times. Every decision is agreed by all ranks, so they run the same
        executions (their collectives match). Recomputes run outside the recorder, whose ring
        keeps the alarmed execution as the evidence until the verdict."""
        previous = alarm.original
        assert previous is not None
        started = time.perf_counter()
        try:
            while alarm.recomputes < self.max_recomputes:
                self._steps.rollback()
                alarm.recomputes += 1
                self._counts["recomputes"] += 1
                outcome: list[tuple[int, int, bool]] = []
                decide = self._recompute_decision(previous, outcome)
                loss, again, kept = self._execute(batch, decide, recompute=True)
                alarm.recomputed = again
                local, agreed, repeated = outcome[0]
                if agreed == _PASSED:
                    self._reproducible_in_a_row = 0
                    self._classify(alarm, "correct" if repeated else "transient")
                    # a rank that only followed another's alarm repeated its own, right step
                    return self._keep(batch, alarm, again, loss, kept, dump=not repeated)
                if agreed == _REPEATED:
                    return self._reproducible(batch, alarm, again, loss, local, kept)
                previous = again
            self._give_up(alarm)
            raise RecomputeLimitError(alarm, self.max_recomputes)
        finally:
            self._recompute_seconds += time.perf_counter() - started

    def _recompute_decision(
        self, previous: Observation, outcome: list[tuple[int, int, bool]]
    ) -> Decide:
        """How a recompute is judged (the outcome, agreed by the ranks, goes in ``outcome``):
        it goes on through the update when every rank passed and no recorder must record it."""

        def decide(again: Observation) -> bool:
            repeated = again.result == previous.result
            local = _PASSED if not self.reasons(again) else _REPEATED if repeated else _OTHER
            agreed = _highest(local, self.group)
            outcome.append((local, agreed, repeated))
            return agreed == _PASSED and self.recorder is None

        return decide

    def _keep(
        self, batch: Any, alarm: Alarm, seen: Observation, loss: Any, kept: bool, *, dump: bool
    ) -> torch.Tensor | None:
        """Training goes on from this step. With a recorder, the ring's alarmed execution is
        dumped (``dump``) and, unless it is the step kept, taken back and the step recorded
        once more; without one, a recompute that was stopped runs once more to be kept."""
        recorder = self.recorder
        if recorder is not None and dump:
            self._dump(alarm)
        if recorder is not None and (dump or not self._steps.keeps_alarmed_execution):
            recorder.rewind()
            self._steps.rollback()
            with recorder.step(batch):
                loss, seen, _ = self._execute(batch, _go_on, recording=True)
        elif not kept:
            self._steps.rollback()
            loss, seen, _ = self._execute(batch, _go_on)
        self._baselines.accept(seen)
        return loss

    def _reproducible(
        self,
        batch: Any,
        alarm: Alarm,
        seen: Observation,
        loss: Any,
        outcome: int,
        kept: bool,
    ) -> torch.Tensor | None:
        """The same result again (on some rank): correct if another device agrees (or,
        without one, unless it keeps happening), else persistent: take it back and raise, on
        every rank."""
        confirmed = True
        if outcome == _REPEATED:
            self._reproducible_in_a_row += 1
            if self.second_opinion is not None:
                confirmed = self.second_opinion(alarm, self._steps.snapshot(), batch)
                if not confirmed:
                    device = getattr(self.second_opinion, "device", None)
                    alarm.contradicted_by = "the second opinion" if device is None else str(device)
            else:
                confirmed = self._reproducible_in_a_row < self.persistent_after
        if not _highest(int(not confirmed), self.group):
            original = alarm.original
            if outcome == _PASSED and original is not None and seen.result != original.result:
                self._reproducible_in_a_row = 0
                self._classify(alarm, "transient")
                return self._keep(batch, alarm, seen, loss, kept, dump=True)
            nonfinite = any(reason.startswith("nonfinite:") for reason in alarm.reasons)
            if _highest(int(outcome == _REPEATED and nonfinite), self.group):
                self._classify(alarm, "correct")  # this device is not accused, yet NaN stays out
                self._give_up(alarm)
                raise NonFiniteResultError(alarm)
            self._classify(alarm, "correct")
            return self._keep(batch, alarm, seen, loss, kept, dump=False)
        self._classify(alarm, "persistent")
        self._give_up(alarm)
        raise PersistentFaultError(alarm)

    def _classify(self, alarm: Alarm, classification: Classification) -> None:
        alarm.classification = classification
        self._counts[classification] += 1
        if self.ledger and classification != "correct":
            device = str(next(self.workload.model.parameters()).device)
            reasons = summarize_reasons(alarm.reasons)
            note(
                [
                    alarm_record(
                        device,
                        alarm.step,
                        classification,
                        reasons,
                        contradicted_by=alarm.contradicted_by,
                    )
                ]
            )

    def _give_up(self, alarm: Alarm) -> None:
        """Dump the alarmed step, then the state as before it (the ring's too)."""
        if self.recorder is not None:
            self._dump(alarm)
            self.recorder.rewind()
        self._steps.rollback()

    def _dump(self, alarm: Alarm) -> None:
        assert self.recorder is not None
        path = self.recorder.dump(
            f"UpdateDetector: step {alarm.step} {summarize_reasons(alarm.reasons)} "
            f"({alarm.classification or 'unresolved'})",
            source="UpdateDetector",
        )
        alarm.bundle = None if path is None else str(path)
