"""The ledger's two homes, one schema: SQLite on this host, PostgreSQL for a fleet.

``SDCREPLAY_LEDGER`` chooses: unset, the SQLite file ``$SDCREPLAY_HOME/ledger.sqlite``;
a path or ``sqlite:///PATH``, that file; ``postgresql://...``, that server (psycopg 3, the
``postgres`` extra); ``off``, none. Plain SQL over the standard ``sqlite3`` module and
psycopg, with a migration table (docs/fleet.md says why, not SQLAlchemy): the default
needs no dependency, and the few statements differ only in their placeholders and in how
each database takes its write lock.

Many writers at once are the normal case (every device process's command on a host, every
host of a fleet): SQLite runs in WAL mode with a busy timeout and takes its write lock
first (``BEGIN IMMEDIATE``); PostgreSQL serializes only the migrations, with an advisory
lock. A record is appended in one transaction or not at all.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..errors import SdcReplayError
from ..home import home_dir
from .schema import COLUMNS, LATEST, MIGRATIONS, Record, from_row, now, row_values

LEDGER_ENV = "SDCREPLAY_LEDGER"
DEFAULT_FILE = "ledger.sqlite"
OFF = "off"
BUSY_SECONDS = 60.0  # a writer waits this long for another's lock before it gives up
CONNECT_SECONDS = 5  # a PostgreSQL server that does not answer in this time is unreachable
_MIGRATION_LOCK = 0x5DC_1ED6E  # pg_advisory_xact_lock key: one migrating process at a time


class LedgerError(SdcReplayError):
    default_hint = (
        "Check SDCREPLAY_LEDGER (a path, sqlite:///PATH, postgresql://... or off) and that the "
        "ledger can be reached and written; docs/fleet.md."
    )


def ledger_location(location: str | None = None) -> str:
    """What ``location`` or ``SDCREPLAY_LEDGER`` names; the default SQLite file otherwise."""
    chosen = location if location is not None else os.environ.get(LEDGER_ENV, "")
    return chosen.strip() or str(home_dir() / DEFAULT_FILE)


def is_off(location: str | None = None) -> bool:
    return ledger_location(location).lower() == OFF


POSTGRES_SCHEMES = ("postgresql", "postgres")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]+):")  # two letters at least: C:\ is a path


def scheme_of(location: str) -> str | None:
    """The URL scheme ``location`` starts with (lower case), None for a plain path."""
    found = _SCHEME.match(location)
    return found[1].lower() if found else None


def is_postgres(location: str) -> bool:
    return scheme_of(location) in POSTGRES_SCHEMES


def shown(location: str) -> str:
    """The location without its password, fit for a message (whatever it holds)."""
    if not is_postgres(location):
        return location
    try:
        parts = urlsplit(location)
        password = parts.password
    except ValueError:  # malformed: hide whatever may follow a ':' before the '@'
        return re.sub(r":[^:@/]*@", ":***@", location)
    if password is None:
        return location
    netloc = parts.netloc.replace(f":{password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def check_location(where: str) -> None:
    """Refuse, by name, what is neither a path, ``sqlite:///PATH`` nor a well-formed
    ``postgresql://`` URL: a typo must not become a relative SQLite file."""
    scheme = scheme_of(where)
    if scheme is None:
        return
    if scheme == "sqlite":
        if not where.lower().startswith("sqlite:///"):
            raise LedgerError(
                f"{where!r} is not a SQLite URL (sqlite:///PATH: three slashes, then the path)"
            )
        return
    if scheme not in POSTGRES_SCHEMES:
        raise LedgerError(
            f"SDCREPLAY_LEDGER={where!r} names the scheme {scheme!r}, which the ledger does not "
            "know (it knows a path, sqlite:///PATH and postgresql://)",
            "Give a path (./name for one with a ':'), sqlite:///PATH, postgresql://HOST/DB, "
            "or off.",
        )
    shape = "postgresql://USER:PASSWORD@HOST:PORT/DB"
    if not where[len(scheme) + 1 :].startswith("//"):
        raise LedgerError(f"{shown(where)!r} is not a PostgreSQL URL (write {shape})")
    try:
        parts = urlsplit(where)
        parts.port  # noqa: B018 - reading it checks it
    except ValueError as exc:
        raise LedgerError(
            f"{shown(where)!r} is not a well-formed URL ({exc}; write {shape})"
        ) from exc


@dataclass
class _Dialect:
    name: str  # "sqlite" or "postgresql"
    serial: str  # the auto-numbered key column

    def sql(self, statement: str) -> str:
        return statement.replace("?", "%s") if self.name == "postgresql" else statement


SQLITE = _Dialect("sqlite", "INTEGER PRIMARY KEY AUTOINCREMENT")
POSTGRESQL = _Dialect("postgresql", "BIGSERIAL PRIMARY KEY")


class Ledger:
    """An open ledger: ``append`` records, read them back (``records``), in time order."""

    def __init__(self, connection: Any, dialect: _Dialect, location: str):
        self._connection = connection
        self.dialect = dialect
        self.location = location

    @property
    def backend(self) -> str:
        return self.dialect.name

    @classmethod
    def open(
        cls,
        location: str | None = None,
        *,
        migrate_to: int = LATEST,
        wait: float | None = None,
        read_only: bool = False,
    ) -> Ledger:
        """Open (creating it when absent) and migrate to ``migrate_to`` (tests build old
        ledgers with a smaller one). ``wait``: seconds to wait at most for a lock or a server
        (default ``BUSY_SECONDS`` and ``CONNECT_SECONDS``). ``read_only``: only read (a
        ledger on a read-only mount; one that does not exist is refused, never created)."""
        where = ledger_location(location)
        if where.lower() == OFF:
            raise LedgerError("the ledger is off (SDCREPLAY_LEDGER=off)")
        check_location(where)
        ledger = (
            cls._postgres(where, CONNECT_SECONDS if wait is None else wait)
            if is_postgres(where)
            else cls._sqlite(where, BUSY_SECONDS if wait is None else wait, read_only)
        )
        try:
            if read_only:
                ledger._require_known_version()
            else:
                ledger._migrate(migrate_to)
        except BaseException:
            ledger.close()
            raise
        return ledger

    @classmethod
    def _sqlite(cls, where: str, wait: float, read_only: bool = False) -> Ledger:
        path = Path(where[len("sqlite://") :] if where.lower().startswith("sqlite:") else where)
        if read_only:
            return cls(cls._sqlite_reader(path, wait), SQLITE, str(path))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            connection = sqlite3.connect(path, timeout=wait, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise LedgerError(f"cannot open the ledger {path}: {exc}") from exc
        try:
            connection.execute(f"PRAGMA busy_timeout = {int(wait * 1000)}")
            connection.execute("PRAGMA journal_mode = WAL")
            connection.execute("PRAGMA synchronous = NORMAL")
        except sqlite3.Error as exc:
            connection.close()
            raise LedgerError(f"cannot open the ledger {path}: {exc}") from exc
        return cls(connection, SQLITE, str(path))

    @staticmethod
    def _sqlite_reader(path: Path, wait: float) -> Any:
        """A connection that never writes: on a read-only mount, a WAL ledger whose
        ``-shm`` cannot be made is read as immutable (nothing there can change it)."""
        if not path.is_file():
            raise LedgerError(
                f"the ledger {path} does not exist",
                "No verdict has been recorded there: check SDCREPLAY_LEDGER or --ledger "
                "(`sdcreplay replay`, `bisect`, `minimize` and `screen` create it).",
            )
        problem: Exception | None = None
        for mode in ("ro", "ro&immutable=1"):
            try:
                uri = f"{path.resolve().as_uri()}?mode={mode}"
                connection = sqlite3.connect(uri, uri=True, timeout=wait, isolation_level=None)
                connection.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()
                return connection
            except sqlite3.Error as exc:
                problem = exc
        raise LedgerError(f"cannot read the ledger {path}: {problem}")

    @classmethod
    def _postgres(cls, where: str, wait: float) -> Ledger:
        try:
            import psycopg
        except ImportError as exc:
            raise LedgerError(
                f"SDCREPLAY_LEDGER names a PostgreSQL ledger ({shown(where)}) but psycopg is "
                "not installed",
                "pip install 'sdcreplay[postgres]' (psycopg 3), or unset SDCREPLAY_LEDGER for "
                "the SQLite file.",
            ) from exc
        try:
            connection = psycopg.connect(
                where, connect_timeout=max(2, math.ceil(wait)), autocommit=True
            )  # libpq's shortest timeout is 2 s
        except psycopg.Error as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise LedgerError(f"cannot reach the ledger {shown(where)}: {first}") from exc
        return cls(connection, POSTGRESQL, shown(where))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._connection.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Any]:
        """One transaction holding the write lock (SQLite: taken before the first read)."""
        cursor = self._connection.cursor()
        cursor.execute("BEGIN IMMEDIATE" if self.dialect is SQLITE else "BEGIN")
        try:
            yield cursor
        except BaseException:
            cursor.execute("ROLLBACK")
            raise
        cursor.execute("COMMIT")

    def _applied(self, cursor: Any) -> int:
        cursor.execute(
            "CREATE TABLE IF NOT EXISTS schema_migrations "
            "(version INTEGER PRIMARY KEY, description TEXT NOT NULL, applied TEXT NOT NULL)"
        )
        cursor.execute("SELECT MAX(version) FROM schema_migrations")
        return int(cursor.fetchone()[0] or 0)

    def _require_known_version(self) -> None:
        """A reader's check: the ledger has the records table, of a version this knows."""
        try:
            version = self.schema_version()
        except Exception as exc:  # no schema_migrations: not a ledger (or an empty file)
            raise LedgerError(f"{self.location} holds no ledger ({exc})") from exc
        if version > LATEST:
            raise _newer(self.location, version)

    def _migrate(self, target: int) -> None:
        with self._writing() as cursor:
            if self.dialect is POSTGRESQL:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
            version = self._applied(cursor)
            if version > LATEST:
                raise _newer(self.location, version)
            for number, description, statements in MIGRATIONS:
                if version < number <= target:
                    for statement in statements:
                        cursor.execute(statement.format(serial=self.dialect.serial))
                    cursor.execute(
                        self.dialect.sql(
                            "INSERT INTO schema_migrations (version, description, applied) "
                            "VALUES (?, ?, ?)"
                        ),
                        (number, description, now()),
                    )

    def schema_version(self) -> int:
        cursor = self._connection.cursor()
        cursor.execute("SELECT MAX(version) FROM schema_migrations")
        return int(cursor.fetchone()[0] or 0)

    def append(self, records: Sequence[Record]) -> None:
        """Append every record in one transaction (all or none)."""
        statement = self.dialect.sql(
            f"INSERT INTO records ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})"
        )
        with self._writing() as cursor:
            cursor.executemany(statement, [row_values(record) for record in records])

    def records(self, device_id: str | None = None) -> list[Record]:
        """Every record (of one device), oldest first."""
        cursor = self._connection.cursor()
        query = "SELECT * FROM records"
        if device_id is None:
            cursor.execute(query + " ORDER BY id")
        else:
            cursor.execute(
                self.dialect.sql(query + " WHERE device_id = ? ORDER BY id"), (device_id,)
            )
        names = [column[0] for column in cursor.description]
        return [from_row(dict(zip(names, row))) for row in cursor.fetchall()]


def _newer(location: str, version: int) -> LedgerError:
    return LedgerError(
        f"the ledger {location} has schema version {version}; this sdcreplay knows versions "
        f"up to {LATEST}",
        "Upgrade sdcreplay here to the version the rest of the fleet runs.",
    )
