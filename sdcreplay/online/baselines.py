"""What is unusual about a step: the update detector's rules and the baselines they compare with.

Apart from the detector because the rules are the same whoever ran the step (the detector
itself, or a trainer callback that only observes), and whether the step was judged before
the optimizer's update or after it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from ..errors import SdcReplayError
from .alarms import Observation

TOTAL_NORM_STEPS = 3
"""Accepted steps after which a jump of the global gradient norm alarms (``grad_norm_jump``):
from the first steps, where Megatron's ``grad_spike`` waits for ``spike_steps``."""


@dataclass(frozen=True)
class Thresholds:
    """The rules' settings (``UpdateDetector``'s keyword arguments of the same names)."""

    alpha: float = 0.05
    sigmas: float = 3.0
    ema_decay: float = 0.9
    window: int = 100
    warmup: int = 10
    spike_factor: float = 10.0
    spike_steps: int = 100
    jump_factor: float = 4.0
    jump_sigmas: float = 6.0

    def __post_init__(self) -> None:
        if (
            self.alpha < 0
            or self.sigmas < 0
            or not 0 <= self.ema_decay < 1
            or self.window < 2
            or self.jump_factor < 1
            or self.jump_sigmas < 0
        ):
            raise SdcReplayError(
                f"UpdateDetector(alpha={self.alpha}, sigmas={self.sigmas}, "
                f"ema_decay={self.ema_decay}, window={self.window}, "
                f"jump_factor={self.jump_factor}, jump_sigmas={self.jump_sigmas}) is not a "
                "threshold",
                "alpha, sigmas, jump_sigmas >= 0; 0 <= ema_decay < 1; window >= 2; "
                "jump_factor >= 1.",
            )


@dataclass
class _Series:
    """One quantity per parameter: its EMA and the sums of its last ``window`` accepted values
    (kept as they go, so a step costs the same whatever the window)."""

    ema: dict[str, float] = field(default_factory=dict)
    recent: dict[str, deque] = field(default_factory=dict)
    sums: dict[str, list[float]] = field(default_factory=dict)  # [sum, sum of squares]

    def add(self, values: dict[str, float], decay: float, window: int) -> None:
        for name, value in values.items():
            previous = self.ema.get(name)
            self.ema[name] = value if previous is None else decay * previous + (1 - decay) * value
            recent = self.recent.setdefault(name, deque(maxlen=window))
            sums = self.sums.setdefault(name, [0.0, 0.0])
            if len(recent) == window:
                oldest = recent[0]
                sums[0] -= oldest
                sums[1] -= oldest * oldest
            recent.append(value)
            sums[0] += value
            sums[1] += value * value

    def spread(self, name: str) -> tuple[float, float] | None:
        """(EMA, standard deviation of the recent values), or None before two are known."""
        recent = self.recent.get(name)
        if recent is None or len(recent) < 2:
            return None
        total, squares = self.sums[name]
        mean = total / len(recent)
        return self.ema[name], math.sqrt(max(squares / len(recent) - mean * mean, 0.0))


class Baselines:
    """The accepted steps' statistics, and the reasons a new step is unusual against them.

    ``nonfinite:loss`` / ``nonfinite:grad:NAME`` / ``nonfinite:update:NAME``: NaN or Inf.
    ``loss_spike`` / ``grad_spike``: the loss / global gradient norm above ``spike_factor``
    x the largest of the first ``spike_steps`` steps (Megatron's rule). ``grad_norm_jump``:
    after ``TOTAL_NORM_STEPS`` accepted steps (or ``warmup``, if fewer), the global gradient
    norm jumps as a parameter's does (below: its own EMA and spread). After ``warmup``
    accepted steps, per parameter: ``grad:NAME``, its gradient norm *jumps*: above both
    ``jump_factor`` x its EMA and its EMA + ``jump_sigmas`` x the spread of its last
    ``window`` accepted norms (both: a small, noisy gradient is judged by its spread, a
    steady one by the factor); ``update:NAME``, its update norm off its EMA by more than
    ``max(alpha x EMA, sigmas x spread)`` (``exact_updates``: the update's own norm, from a
    copy) or, measured on a sketch of the update (its rows' sums), jumps as a gradient does.
    """

    def __init__(self, thresholds: Thresholds, *, exact_updates: bool):
        self.thresholds = thresholds
        self.exact_updates = exact_updates
        self.accepted = 0
        self._grads = _Series()
        self._total = _Series()  # the global gradient norm, as "total"
        self._updates = _Series()
        self._first_losses: list[float] = []
        self._first_grad_norms: list[float] = []

    def reasons(self, seen: Observation) -> list[str]:
        """Why ``seen`` is unusual (empty: it is not)."""
        before = self.reasons_before_update(seen)
        return before if _nonfinite(before) else before + self.reasons_of_update(seen)

    def reasons_before_update(self, seen: Observation) -> list[str]:
        """The reasons its loss and gradients give (the update is not judged)."""
        found = []
        if seen.loss is not None and not math.isfinite(seen.loss):
            found.append("nonfinite:loss")
        found += [f"nonfinite:grad:{n}" for n, v in seen.grad_norms.items() if not math.isfinite(v)]
        if found:
            return found
        limits = self.thresholds
        if _spikes(seen.loss, self._first_losses, limits.spike_steps, limits.spike_factor):
            found.append("loss_spike")
        if seen.grad_norms and _spikes(
            seen.grad_norm, self._first_grad_norms, limits.spike_steps, limits.spike_factor
        ):
            found.append("grad_spike")
        early = self.accepted >= min(limits.warmup, TOTAL_NORM_STEPS)
        if seen.grad_norms and early and self._jumps(self._total, _total(seen)):
            found.append("grad_norm_jump")
        if self.accepted < limits.warmup:
            return found
        found += [f"grad:{name}" for name in self._jumps(self._grads, seen.grad_norms)]
        return found

    def reasons_of_update(self, seen: Observation) -> list[str]:
        """The reasons its update gives."""
        nonfinite = [f"nonfinite:update:{n}" for n, v in seen.update_norms.items()]
        nonfinite = [
            r for r, v in zip(nonfinite, seen.update_norms.values()) if not math.isfinite(v)
        ]
        if nonfinite or self.accepted < self.thresholds.warmup:
            return nonfinite
        limits, found = self.thresholds, []
        sigmas = limits.sigmas if self.exact_updates else limits.jump_sigmas
        for name, norm in seen.update_norms.items():
            spread = self._updates.spread(name)
            known = len(self._updates.recent.get(name, ()))  # the first update has no sketch
            if spread is not None and (self.exact_updates or known >= limits.warmup):
                ema, std = spread
                if abs(norm - ema) > max(limits.alpha * ema, sigmas * std):
                    found.append(f"update:{name}")
        return found

    def _jumps(self, series: _Series, values: dict[str, float]) -> list[str]:
        """The names whose value jumps above both ``jump_factor`` x its EMA and its EMA +
        ``jump_sigmas`` x its spread."""
        limits, found = self.thresholds, []
        for name, norm in values.items():
            spread = series.spread(name)
            if spread is not None:
                ema, std = spread
                if norm > max(limits.jump_factor * ema, ema + limits.jump_sigmas * std):
                    found.append(name)
        return found

    def accept(self, seen: Observation) -> None:
        """``seen`` is a step training goes on from: it joins the statistics."""
        limits = self.thresholds
        self.accepted += 1
        self._grads.add(seen.grad_norms, limits.ema_decay, limits.window)
        if seen.grad_norms:
            self._total.add(_total(seen), limits.ema_decay, limits.window)
        self._updates.add(seen.update_norms, limits.ema_decay, limits.window)
        if seen.loss is not None and len(self._first_losses) < limits.spike_steps:
            self._first_losses.append(abs(seen.loss))
        if seen.grad_norms and len(self._first_grad_norms) < limits.spike_steps:
            self._first_grad_norms.append(seen.grad_norm)


def _total(seen: Observation) -> dict[str, float]:
    return {"total": seen.grad_norm}


def _nonfinite(reasons: list[str]) -> bool:
    return any(reason.startswith("nonfinite:") for reason in reasons)


def _spikes(value: float | None, first: list[float], steps: int, factor: float) -> bool:
    """Megatron's rule: above ``factor`` x the largest of the first ``steps`` values (which
    must all have been seen)."""
    return value is not None and len(first) >= steps and abs(value) > factor * max(first)
