"""Appending a command's verdicts to the ledger without ever failing the command.

A verdict matters more than its bookkeeping: a ledger that cannot be opened, reached or
written (a read-only home, a PostgreSQL server down or silent, psycopg missing, a value of
``SDCREPLAY_LEDGER`` that names no ledger) costs one warning and nothing else, and never
more time than ``wait``: the append runs in a thread of its own that is given up at its
deadline (psycopg's own connect timeout is whole seconds, 2 at least; loading libpq,
once per process, is the one wait no deadline cuts).

Library calls (replay, bisect, minimize, screen, the online detectors, ring dumps) append
here unless told not to (``ledger=False``, which holds for everything the call runs inside;
``--no-ledger`` on the command line; ``SDCREPLAY_LEDGER=off`` for everything). The warning
is a `LedgerWarning` for a Python user; the command line shows it as ``Warning: ...``
(`warnings_to`).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence

from ..errors import message_of
from .schema import Record
from .store import (
    BUSY_SECONDS,
    CONNECT_SECONDS,
    Ledger,
    LedgerError,
    is_off,
    is_postgres,
    ledger_location,
    shown,
)
from .tracker import append_tracker_lines
from .verdicts import records_for


class LedgerWarning(UserWarning):
    """The ledger could not take a verdict; the command's own result stands."""


_handlers: list[tuple[Callable[[str], None], set[str]]] = []  # and what each was told


@contextlib.contextmanager
def warnings_to(handler: Callable[[str], None]) -> Iterator[None]:
    """While inside: ledger warnings go to ``handler`` (the command line's ``Output.warn``),
    each once (a command that appends several times says its ledger's problem once)."""
    entry: tuple[Callable[[str], None], set[str]] = (handler, set())
    _handlers.append(entry)
    try:
        yield
    finally:
        _handlers.remove(entry)


def _warn(message: str) -> None:
    if _handlers:
        handler, told = _handlers[-1]
        if message not in told:
            told.add(message)
            handler(message)
    else:
        warnings.warn(message, LedgerWarning, stacklevel=4)


def note(
    records: Sequence[Record], location: str | None = None, *, wait: float | None = None
) -> bool:
    """Append ``records``; False (and a warning) when the ledger could not take them.
    ``wait``: seconds at most for the whole append (its lock, its server); never more than
    any command waits (a server's 5 s, another writer's lock 60 s), so a screen with a long
    budget does not spend it on a silent server."""
    if not records or is_off(location):
        return False
    chosen = ledger_location(location)
    where = shown(chosen)
    usual = CONNECT_SECONDS if is_postgres(chosen) else BUSY_SECONDS
    wait = usual if wait is None else min(wait, usual)
    outcome: list[BaseException | None] = []
    given_up = threading.Event()

    def append() -> None:
        try:
            with Ledger.open(location, wait=wait) as ledger:
                if not given_up.is_set():
                    ledger.append(records)
            outcome.append(None)
        except BaseException as exc:  # reported by the caller's thread
            outcome.append(exc)

    worker = threading.Thread(target=append, name="sdcreplay-ledger", daemon=True)
    worker.start()
    worker.join(wait)
    if not outcome:
        given_up.set()
        _warn(
            f"the ledger {where} did not answer in {wait:.3g} s; the verdict is not in the "
            "ledger (check the server, or set SDCREPLAY_LEDGER=off)"
        )
        return False
    problem = outcome[0]
    if problem is None:
        append_tracker_lines(records)
        return True
    if isinstance(problem, LedgerError):
        _warn(f"{problem.message}; the verdict is not in the ledger ({problem.hint})")
    elif isinstance(problem, Exception):  # sqlite3, psycopg or OS errors: never the command's
        _warn(
            f"the ledger {where} could not be written "
            f"({type(problem).__name__}: {message_of(problem)}); "
            "the verdict is not in the ledger"
        )
    else:
        raise problem
    return False


def note_result(result: dict, location: str | None = None, *, wait: float | None = None) -> bool:
    """Append the records a command's JSON result makes (`verdicts.records_for`)."""
    try:
        records = records_for(result)
    except Exception as exc:  # a result this version cannot read: a warning, like a write
        _warn(f"the result could not be turned into ledger records ({message_of(exc)})")
        return False
    return note(records, location, wait=wait)
