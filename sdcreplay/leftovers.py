"""What an interrupted command leaves on disk, named with what to do about it.

A writer says what it is writing while it writes (`writing`). When an interruption (^C or
SIGTERM: a ``KeyboardInterrupt``) passes through, each such path that exists is attached to
the exception (`left_by`) and said in its notes, so the command line prints
it and a Python caller's traceback shows it.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_ATTRIBUTE = "sdcreplay_leftovers"


@dataclass(frozen=True)
class Leftover:
    path: Path
    what: str  # e.g. "an unfinished bundle"
    advice: str  # what the person can do with it

    def __str__(self) -> str:
        return f"{self.path}: {self.what}; {self.advice}"


@contextlib.contextmanager
def writing(path: str | Path, what: str, advice: str) -> Iterator[None]:
    """While the body runs, ``path`` is being written; an interruption names it."""
    try:
        yield
    except KeyboardInterrupt as exc:
        if os.path.lexists(path):
            left = Leftover(Path(path), what, advice)
            setattr(exc, _ATTRIBUTE, [*left_by(exc), left])
            if sys.version_info >= (3, 11):  # a Python caller's traceback shows it
                exc.add_note(f"Left behind: {left}")
        raise


def left_by(exc: BaseException) -> list[Leftover]:
    """What the interruption ``exc`` left on disk, a path inside another one said once."""
    found: list[Leftover] = getattr(exc, _ATTRIBUTE, [])
    return [
        left
        for left in found
        if not any(other.path in left.path.parents for other in found if other is not left)
    ]
