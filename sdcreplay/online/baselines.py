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
    grad_factor: float = 4.0
    grad_sigmas: float = 6.0

    def __post_init__(self) -> None:
        if (
            self.alpha < 0
            or self.sigmas < 0
            or not 0 <= self.ema_decay < 1
            or self.window < 2
            or self.grad_factor < 1
            or self.grad_sigmas < 0
        ):
            raise SdcReplayError(
                f"UpdateDetector(alpha={self.alpha}, sigmas={self.sigmas}, "
                f"ema_decay={self.ema_decay}, window={self.window}, "
                f"grad_factor={self.grad_factor}, grad_sigmas={self.grad_sigmas}) is not a "
                "threshold",
                "alpha, sigmas, grad_sigmas >= 0; 0 <= ema_decay < 1; window >= 2; "
                "grad_factor >= 1.",
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
    x the largest of the first ``spike_steps`` steps (Megatron's rule). After ``warmup``
    accepted steps, per parameter: ``grad:NAME``, its gradient norm above both
    ``grad_factor`` x its EMA and its EMA + ``grad_sigmas`` x the spread of its last
    ``window`` accepted norms (both: a small, noisy gradient is judged by its spread, a
    steady one by the factor); ``update:NAME`` (judged after the update only), its update
    norm off its EMA by more than ``max(alpha x EMA, sigmas x spread)``.
    """

    def __init__(self, thresholds: Thresholds):
        self.thresholds = thresholds
        self.accepted = 0
        self._grads = _Series()
        self._updates = _Series()
        self._first_losses: list[float] = []
        self._first_grad_norms: list[float] = []

    def reasons(self, seen: Observation) -> list[str]:
        """Why ``seen`` is unusual (empty: it is not)."""
        found = []
        if seen.loss is not None and not math.isfinite(seen.loss):
            found.append("nonfinite:loss")
        found += [f"nonfinite:grad:{n}" for n, v in seen.grad_norms.items() if not math.isfinite(v)]
        found += [
            f"nonfinite:update:{n}" for n, v in seen.update_norms.items() if not math.isfinite(v)
        ]
        if found:
            return found
        limits = self.thresholds
        if _spikes(seen.loss, self._first_losses, limits.spike_steps, limits.spike_factor):
            found.append("loss_spike")
        if seen.grad_norms and _spikes(
            seen.grad_norm, self._first_grad_norms, limits.spike_steps, limits.spike_factor
        ):
            found.append("grad_spike")
        if self.accepted < limits.warmup:
            return found
        for name, norm in seen.grad_norms.items():
            spread = self._grads.spread(name)
            if spread is not None:
                ema, std = spread
                if norm > max(limits.grad_factor * ema, ema + limits.grad_sigmas * std):
                    found.append(f"grad:{name}")
        for name, norm in seen.update_norms.items():
            spread = self._updates.spread(name)
            if spread is not None:
                ema, std = spread
                if abs(norm - ema) > max(limits.alpha * ema, limits.sigmas * std):
                    found.append(f"update:{name}")
        return found

    def accept(self, seen: Observation) -> None:
        """``seen`` is a step training goes on from: it joins the statistics."""
        limits = self.thresholds
        self.accepted += 1
        self._grads.add(seen.grad_norms, limits.ema_decay, limits.window)
        self._updates.add(seen.update_norms, limits.ema_decay, limits.window)
        if seen.loss is not None and len(self._first_losses) < limits.spike_steps:
            self._first_losses.append(abs(seen.loss))
        if seen.grad_norms and len(self._first_grad_norms) < limits.spike_steps:
            self._first_grad_norms.append(seen.grad_norm)


def _spikes(value: float | None, first: list[float], steps: int, factor: float) -> bool:
    """Megatron's rule: above ``factor`` x the largest of the first ``steps`` values (which
    must all have been seen)."""
    return value is not None and len(first) >= steps and abs(value) > factor * max(first)
