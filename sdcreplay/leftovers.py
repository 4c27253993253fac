"""What an interrupted command leaves on disk, named with what to do about it.

A writer says what it is writing while it writes: `begin` and `end` around it, or the body of
`writing`. When an interruption (^C or SIGTERM: a ``KeyboardInterrupt``) ends the command,
`take` gives each of those paths that exists (the command line prints them), and `writing`
adds them to the exception's notes, so a Python caller's traceback shows them too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Leftover:
    path: Path
    what: str  # e.g. "an unfinished bundle"
    advice: str  # what the person can do with it

    def __str__(self) -> str:
        return f"{self.path}: {self.what}; {self.advice}"


_being_written: dict[Path, Leftover] = {}


def begin(path: str | Path, what: str, advice: str) -> None:
    _being_written[Path(path)] = Leftover(Path(path), what, advice)


def end(path: str | Path) -> None:
    _being_written.pop(Path(path), None)


@contextlib.contextmanager
def writing(path: str | Path, what: str, advice: str) -> Iterator[None]:
    """``path`` is being written while the body runs; an interruption leaves it named."""
    begin(path, what, advice)
    try:
        yield
    except KeyboardInterrupt as exc:
        if os.path.lexists(path) and sys.version_info >= (3, 11):
            exc.add_note(f"Left behind: {_being_written[Path(path)]}")
        raise
    except BaseException:
        end(path)
        raise
    end(path)


def leave(path: str | Path, what: str, advice: str, interruption: KeyboardInterrupt) -> None:
    """``path`` is what a command keeps on purpose as ``interruption`` ends it (a partial
    result, nothing measured lost): named as every leftover is, and in its notes."""
    begin(path, what, advice)
    if sys.version_info >= (3, 11):
        interruption.add_note(f"Left behind: {_being_written[Path(path)]}")


def take() -> list[Leftover]:
    """What is being written and exists, a path inside another one said through that one;
    forgotten once taken."""
    found = [left for left in _being_written.values() if os.path.lexists(left.path)]
    _being_written.clear()
    return [
        left
        for left in found
        if not any(other.path in left.path.parents for other in found if other is not left)
    ]


def forget() -> None:
    """A new command begins: nothing an earlier one in this process began is its leftover."""
    _being_written.clear()
