"""Appending a command's verdicts to the ledger without ever failing the command.

A verdict matters more than its bookkeeping: a ledger that cannot be opened, reached or
written (a read-only home, a PostgreSQL server down, psycopg missing) costs a warning and
nothing else. Library calls (replay, bisect, minimize, screen, the online detectors, ring
dumps) append here unless told not to (``ledger=False``; ``--no-ledger`` on the command
line; ``SDCREPLAY_LEDGER=off`` for everything). The warning is a `LedgerWarning` for a
Python user; the command line shows it as ``Warning: ...`` (`warnings_to`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence

from ..errors import message_of
from .schema import Record
from .store import Ledger, LedgerError, is_off, ledger_location, shown
from .tracker import append_tracker_lines
from .verdicts import records_for


class LedgerWarning(UserWarning):
    """The ledger could not take a verdict; the command's own result stands."""


_handlers: list[Callable[[str], None]] = []


@contextlib.contextmanager
def warnings_to(handler: Callable[[str], None]) -> Iterator[None]:
    """While inside: ledger warnings go to ``handler`` (the command line's ``Output.warn``)."""
    _handlers.append(handler)
    try:
        yield
    finally:
        _handlers.remove(handler)


def _warn(message: str) -> None:
    if _handlers:
        _handlers[-1](message)
    else:
        warnings.warn(message, LedgerWarning, stacklevel=4)


def note(
    records: Sequence[Record], location: str | None = None, *, wait: float | None = None
) -> bool:
    """Append ``records``; False (and a warning) when the ledger could not take them.
    ``wait``: seconds to wait at most for the ledger's lock or server."""
    if not records or is_off(location):
        return False
    where = shown(ledger_location(location))
    try:
        with Ledger.open(location, wait=wait) as ledger:
            ledger.append(records)
        append_tracker_lines(records)
        return True
    except LedgerError as exc:
        _warn(f"{exc.message}; the verdict is not in the ledger ({exc.hint})")
    except Exception as exc:  # sqlite3, psycopg or OS errors: never the command's failure
        _warn(
            f"the ledger {where} could not be written ({type(exc).__name__}: {message_of(exc)}); "
            "the verdict is not in the ledger"
        )
    return False


def note_result(result: dict, location: str | None = None, *, wait: float | None = None) -> bool:
    """Append the records a command's JSON result makes (`verdicts.records_for`)."""
    try:
        records = records_for(result)
    except Exception as exc:  # a result this version cannot read: a warning, like a write
        _warn(f"the result could not be turned into ledger records ({message_of(exc)})")
        return False
    return note(records, location, wait=wait)
