"""The update detector: alarms on unusual optimizer updates inside training.

``UpdateDetector`` watches the statistics of each optimizer update (update norms
against an EMA baseline, NaN/Inf, Megatron's loss and gradient-norm spikes) and,
on an alarm, rolls the step back, recomputes it and classifies the alarm as
Megatron's rerun state machine does. It drives the loop's own step and, given a
ring ``Recorder``, records every step through it and dumps a bundle when an alarm
needs evidence. See docs/online.md.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..capture.operators import _own_work
from ..capture.snapshot import TrainingSnapshot
from ..errors import SdcReplayError
from ..ledger.notes import note
from ..ledger.verdicts import alarm_record
from ..workload.definition import Workload
from .agreement import _highest
from .alarms import Alarm, Classification, Observation, observe, summarize_reasons
from .second_opinion import SecondOpinion
from .step import step_workload
from .stopping import NonFiniteResultError, PersistentFaultError, RecomputeLimitError

PEER_ALARM = "peer"
"""The reason on a rank that raised no alarm itself but rolls back with one that did."""

# What a recompute showed, ordered so that the largest over the ranks decides for all.
_PASSED, _REPEATED, _OTHER = 0, 1, 2


@dataclass
class _Baselines:
    """Per-parameter EMA and recent window of update norms; Megatron's spike references."""

    ema: dict[str, float] = field(default_factory=dict)
    recent: dict[str, deque] = field(default_factory=dict)
    accepted: int = 0
    first_losses: list[float] = field(default_factory=list)
    first_grad_norms: list[float] = field(default_factory=list)


class UpdateDetector:
    """Runs the loop's step and alarms on unusual optimizer updates; rolls back and recomputes.

    Checks, after each step (seeds/001 and Megatron's rerun state machine):
    ``nonfinite:loss``, ``nonfinite:grad:NAME``, ``nonfinite:update:NAME``;
    ``loss_spike`` / ``grad_spike``: the loss / global gradient norm (taken at the
    optimizer's step, before it) above ``spike_factor`` x the largest of the first
    ``spike_steps`` steps; ``update:NAME``: the parameter's update norm differs from
    its EMA by more than ``max(alpha * EMA, sigmas * std)`` of its last ``window``
    accepted updates (after ``warmup`` accepted steps).

    On an alarm the step is rolled back (``TrainingSnapshot`` taken before it) and
    recomputed on the same device. A different result is ``transient`` (the
    recompute is kept once it passes); the same result is reproducible: ``correct``
    when ``second_opinion`` confirms it elsewhere, ``persistent`` when it does not
    (the step is rolled back and ``PersistentFaultError`` raised). Without a second
    opinion a reproducible alarm is ``correct``, unless the last ``persistent_after``
    steps all ended in reproducible alarms: then ``persistent``. Under torch.distributed
    the ranks of ``group`` agree on every decision, so they run the same executions.
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
        alpha: float = 0.05,
        sigmas: float = 3.0,
        ema_decay: float = 0.9,
        window: int = 100,
        warmup: int = 10,
        spike_factor: float = 10.0,
        spike_steps: int = 100,
        max_recomputes: int = 3,
        persistent_after: int = 3,
        second_opinion: SecondOpinion | None = None,
        snapshot_device: torch.device | str | None = None,
        recorder: Any = None,
        start_step: int = 0,
        group: Any = None,
        ledger: bool = True,
    ):
        if alpha < 0 or sigmas < 0 or not 0 <= ema_decay < 1 or window < 2:
            raise SdcReplayError(
                f"UpdateDetector(alpha={alpha}, sigmas={sigmas}, ema_decay={ema_decay}, "
                f"window={window}) is not a threshold",
                "alpha, sigmas >= 0; 0 <= ema_decay < 1; window >= 2.",
            )
        if max_recomputes < 1 or persistent_after < 1:
            raise SdcReplayError("max_recomputes and persistent_after must be at least 1")
        self.workload = step_workload(
            workload, model, optimizer, train_step, loss_fn, state, "UpdateDetector"
        )
        self.alpha, self.sigmas, self.ema_decay = alpha, sigmas, ema_decay
        self.window, self.warmup = window, warmup
        self.spike_factor, self.spike_steps = spike_factor, spike_steps
        self.max_recomputes, self.persistent_after = max_recomputes, persistent_after
        self.second_opinion = second_opinion
        self.group = group
        self.ledger = ledger  # append transient and persistent alarms to the device ledger
        self.snapshot_device = snapshot_device
        self.recorder = recorder
        self.next_step = start_step
        self.alarms: list[Alarm] = []
        self._baselines = _Baselines()
        self._reproducible_in_a_row = 0
        self._counts: Counter[str] = Counter()
        self._overhead = 0.0
        self._recompute_seconds = 0.0
        self._grad_norms: dict[str, float] | None = None
        self._step_seconds = 0.0
        self._hook = self.workload.optimizer.register_step_pre_hook(self._optimizer_begins)

    def close(self) -> None:
        """Remove the optimizer hook."""
        self._hook.remove()

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
            with _own_work():
                snapshot = TrainingSnapshot.take(
                    self.workload.model,
                    self.workload.optimizer,
                    self.workload.state,
                    device=self.snapshot_device,
                )
            recording = self.recorder.step(batch) if self.recorder is not None else None
            with recording if recording is not None else contextlib.nullcontext():
                loss, original = self._observe(batch, snapshot)
            step_seconds = self._step_seconds
            reasons = self.reasons(original)
            if not _highest(int(bool(reasons)), self.group):  # every rank agrees: no alarm
                self._reproducible_in_a_row = 0
                self._accept(original)
                return loss
            reasons = reasons or [PEER_ALARM]  # rolled back with the rank that alarmed
            self._counts["detections"] += 1
            alarm = Alarm(step, reasons, original=original)
            self.alarms.append(alarm)
            return self._resolve(batch, snapshot, alarm, loss)
        finally:  # everything but the loop's own step (the first execution) is overhead
            self._overhead += time.perf_counter() - started - step_seconds

    def judge(self, seen: Observation, *, step: int) -> Alarm | None:
        """Judge a step the detector did not run (a Trainer callback's): a clean one joins the
        baselines; an alarm is dumped (with a recorder), neither rolled back nor recomputed."""
        self._counts["steps"] += 1
        self.next_step = step + 1
        reasons = self.reasons(seen)
        if not reasons:
            self._accept(seen)
            return None
        self._counts["detections"] += 1
        alarm = Alarm(step, reasons, original=seen)
        self.alarms.append(alarm)
        if self.recorder is not None:
            self._dump(alarm)
        return alarm

    def _observe(self, batch: Any, snapshot: TrainingSnapshot) -> tuple[Any, Observation]:
        self._grad_norms = {}
        started = time.perf_counter()
        try:
            loss = self.workload.run_step(batch)
            grad_norms = self._grad_norms
        finally:
            self._grad_norms = None
            self._step_seconds = time.perf_counter() - started
        return loss, observe(self.workload.model, snapshot, loss, grad_norms)

    def _optimizer_begins(self, optimizer, args, kwargs) -> None:
        if self._grad_norms is None or self._grad_norms:
            return
        with _own_work():
            named = [
                (n, p.grad) for n, p in self.workload.model.named_parameters() if p.grad is not None
            ]
            if named:
                norms = torch.stack(
                    [torch.linalg.vector_norm(g, dtype=torch.float64) for _, g in named]
                )
                self._grad_norms.update(zip([n for n, _ in named], norms.tolist()))

    def reasons(self, seen: Observation) -> list[str]:
        """Why ``seen`` is unusual against the baselines (empty: it is not)."""
        found = []
        if seen.loss is not None and not math.isfinite(seen.loss):
            found.append("nonfinite:loss")
        found += [f"nonfinite:grad:{n}" for n, v in seen.grad_norms.items() if not math.isfinite(v)]
        found += [
            f"nonfinite:update:{n}" for n, v in seen.update_norms.items() if not math.isfinite(v)
        ]
        if found:
            return found
        base = self._baselines
        if _spikes(seen.loss, base.first_losses, self.spike_steps, self.spike_factor):
            found.append("loss_spike")
        if seen.grad_norms and _spikes(
            seen.grad_norm, base.first_grad_norms, self.spike_steps, self.spike_factor
        ):
            found.append("grad_spike")
        if base.accepted >= self.warmup:
            for name, norm in seen.update_norms.items():
                recent = base.recent.get(name)
                if recent is None or len(recent) < 2:
                    continue
                ema = base.ema[name]
                std = _std(recent)
                if abs(norm - ema) > max(self.alpha * ema, self.sigmas * std):
                    found.append(f"update:{name}")
        return found

    def _accept(self, seen: Observation) -> None:
        base = self._baselines
        base.accepted += 1
        for name, norm in seen.update_norms.items():
            previous = base.ema.get(name)
            base.ema[name] = (
                norm
                if previous is None
                else self.ema_decay * previous + (1 - self.ema_decay) * norm
            )
            base.recent.setdefault(name, deque(maxlen=self.window)).append(norm)
        if seen.loss is not None and len(base.first_losses) < self.spike_steps:
            base.first_losses.append(abs(seen.loss))
        if seen.grad_norms and len(base.first_grad_norms) < self.spike_steps:
            base.first_grad_norms.append(seen.grad_norm)

    def _resolve(
        self, batch: Any, snapshot: TrainingSnapshot, alarm: Alarm, loss: Any
    ) -> torch.Tensor | None:
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
                with _own_work():
                    snapshot.restore()
                alarm.recomputes += 1
                self._counts["recomputes"] += 1
                loss, again = self._observe(batch, snapshot)
                alarm.recomputed = again
                repeated = again.result == previous.result
                outcome = _PASSED if not self.reasons(again) else _REPEATED if repeated else _OTHER
                agreed = _highest(outcome, self.group)
                if agreed == _PASSED:
                    if repeated:  # this rank only followed: its step was right
                        return self._correct(alarm, again, loss)
                    return self._transient(batch, snapshot, alarm, again, loss)
                if agreed == _REPEATED:
                    return self._reproducible(batch, snapshot, alarm, again, loss, outcome)
                previous = again
            self._give_up(snapshot, alarm)
            raise RecomputeLimitError(alarm, self.max_recomputes)
        finally:
            self._recompute_seconds += time.perf_counter() - started

    def _transient(
        self, batch: Any, snapshot: TrainingSnapshot, alarm: Alarm, kept: Observation, loss: Any
    ) -> torch.Tensor | None:
        """Keep the recompute. With a recorder: dump the alarmed execution, take it back, and
        record the step once more so the ring holds what training goes on from."""
        self._reproducible_in_a_row = 0
        self._classify(alarm, "transient")
        if self.recorder is not None:
            self._dump(alarm)
            self.recorder.rewind()
            with _own_work():
                snapshot.restore()
            with self.recorder.step(batch):
                loss, kept = self._observe(batch, snapshot)
        self._accept(kept)
        return loss

    def _correct(self, alarm: Alarm, kept: Observation, loss: Any) -> torch.Tensor | None:
        self._classify(alarm, "correct")
        self._accept(kept)
        return loss

    def _reproducible(
        self,
        batch: Any,
        snapshot: TrainingSnapshot,
        alarm: Alarm,
        seen: Observation,
        loss: Any,
        outcome: int,
    ) -> torch.Tensor | None:
        """The same result again (on some rank): correct if another device agrees (or,
        without one, unless it keeps happening), else persistent: roll back and raise, on
        every rank."""
        confirmed = True
        if outcome == _REPEATED:
            self._reproducible_in_a_row += 1
            if self.second_opinion is not None:
                confirmed = self.second_opinion(alarm, snapshot, batch)
                if not confirmed:
                    device = getattr(self.second_opinion, "device", None)
                    alarm.contradicted_by = "the second opinion" if device is None else str(device)
            else:
                confirmed = self._reproducible_in_a_row < self.persistent_after
        if not _highest(int(not confirmed), self.group):
            original = alarm.original
            if outcome == _PASSED and original is not None and seen.result != original.result:
                return self._transient(batch, snapshot, alarm, seen, loss)
            nonfinite = any(reason.startswith("nonfinite:") for reason in alarm.reasons)
            if _highest(int(outcome == _REPEATED and nonfinite), self.group):
                self._classify(alarm, "correct")  # this device is not accused, yet NaN stays out
                self._give_up(snapshot, alarm)
                raise NonFiniteResultError(alarm)
            return self._correct(alarm, seen, loss)
        self._classify(alarm, "persistent")
        self._give_up(snapshot, alarm)
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

    def _give_up(self, snapshot: TrainingSnapshot, alarm: Alarm) -> None:
        """Dump the alarmed step, then the state as before it (the ring's too)."""
        if self.recorder is not None:
            self._dump(alarm)
            self.recorder.rewind()
        with _own_work():
            snapshot.restore()

    def _dump(self, alarm: Alarm) -> None:
        assert self.recorder is not None
        path = self.recorder.dump(
            f"UpdateDetector: step {alarm.step} {summarize_reasons(alarm.reasons)} "
            f"({alarm.classification or 'unresolved'})",
            source="UpdateDetector",
        )
        alarm.bundle = str(path)


def _spikes(value: float | None, first: list[float], steps: int, factor: float) -> bool:
    """Megatron's rule: above ``factor`` x the largest of the first ``steps`` values (which
    must all have been seen)."""
    return value is not None and len(first) >= steps and abs(value) > factor * max(first)


def _std(values: deque) -> float:
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
