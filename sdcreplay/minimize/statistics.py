"""The numbers behind a verdict from repeated trials, kept apart from torch and the devices.

A failure rate measured in N trials is stated with an interval that stays
sound at 0 of N and N of N, and the acceptance rule's ``bad_trials`` is chosen
from the measured rate so that a candidate that still fails is rarely missed.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # two-sided 95% quantile of the normal distribution
MISS_PROBABILITY = (
    0.01  # the default --bad-trials misses a failure at the measured rate this rarely
)


def wilson_interval(failures: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a failure rate: sound at 0 of N and N of N, unlike p +- z*se."""
    if trials <= 0:
        return (0.0, 1.0)
    rate = failures / trials
    spread = z * z / trials
    center = (rate + spread / 2) / (1 + spread)
    half = z * math.sqrt(rate * (1 - rate) / trials + spread / (4 * trials)) / (1 + spread)
    low = 0.0 if failures == 0 else max(0.0, center - half)
    high = 1.0 if failures == trials else min(1.0, center + half)
    return (low, high)


def default_bad_trials(rate: float, trials: int) -> int:
    """Trials that see a failure at ``rate`` with probability 1 - MISS_PROBABILITY, at most
    ``trials``."""
    if rate >= 1.0:
        return 1
    if rate <= 0.0:
        return trials
    return max(1, min(trials, math.ceil(math.log(MISS_PROBABILITY) / math.log1p(-rate))))
