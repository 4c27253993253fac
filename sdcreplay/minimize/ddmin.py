"""Zeller's delta debugging, pure: the search knows nothing of tensors or devices, so the
shrink (shrink.py) can run it over the indices of one axis at a time."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


def ddmin(units: Sequence, test: Callable[[tuple], bool]) -> tuple:
    """Zeller's delta debugging: a 1-minimal subset of ``units`` for which ``test`` holds.

    ``test(units)`` is known to hold. The result is never empty, and removing
    any one of its units makes ``test`` fail. Pure: caching and keeping the
    best so far (for an interruption) belong to ``test``.
    """
    current = tuple(units)
    granularity = 2
    while len(current) >= 2:
        chunks = _split(current, granularity)
        subset = next((chunk for chunk in chunks if test(chunk)), None)
        if subset is not None:
            current, granularity = subset, 2
            continue
        complements = (
            []
            if granularity == 2
            else (
                tuple(
                    unit for other, chunk in enumerate(chunks) if other != skipped for unit in chunk
                )
                for skipped in range(len(chunks))
            )
        )
        subset = next((complement for complement in complements if test(complement)), None)
        if subset is not None:
            current, granularity = subset, max(granularity - 1, 2)
        elif granularity >= len(current):
            break
        else:
            granularity = min(2 * granularity, len(current))
    return current


def _split(units: tuple, parts: int) -> list[tuple]:
    size, extra = divmod(len(units), parts)
    bounds = list(itertools.accumulate([0] + [size + (i < extra) for i in range(parts)]))
    return [units[start:end] for start, end in itertools.pairwise(bounds)]
