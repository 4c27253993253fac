"""The ledger's store on both backends (SQLite, and the real PostgreSQL server .ci/run starts):
many writers at once lose nothing, an older schema is migrated with every record kept, and a
ledger that cannot be written costs a warning, never the command."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from conftest import REPO, TESTS

from sdcreplay.ledger.notes import LedgerWarning, note
from sdcreplay.ledger.schema import LATEST, Record
from sdcreplay.ledger.store import Ledger, LedgerError

WRITERS, RECORDS = 8, 100


def test_eight_writers_at_once_lose_no_record(ledger_url: str):
    """8 processes open a ledger that does not exist yet (each creates and migrates it) and
    append 100 records each, one transaction per record, all at the same time."""
    writers = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "ledger_writer.py"), ledger_url, str(n), str(RECORDS)],
            cwd=REPO,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(WRITERS)
    ]
    for writer in writers:
        _, stderr = writer.communicate(timeout=300)
        assert writer.returncode == 0, stderr[-2000:]
    with Ledger.open(ledger_url) as ledger:
        records = ledger.records()
        assert ledger.schema_version() == LATEST
    written = sorted((r.label, r.iteration) for r in records)
    assert written == sorted((f"cpu:{n}", i) for n in range(WRITERS) for i in range(RECORDS))
    assert len({r.id for r in records}) == WRITERS * RECORDS
    for n in range(WRITERS):  # each writer's records in the order it wrote them
        mine = [r.iteration for r in records if r.label == f"cpu:{n}"]
        assert mine == list(range(RECORDS))


V1_INSERT = (
    "INSERT INTO records (time, device_id, host, job, command, verdict, evidence, report, "
    "tool_version) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
V1_ROWS = [
    (
        f"2025-01-0{i + 1}T00:00:00+00:00",
        device,
        "h17",
        job,
        "replay",
        verdict,
        text,
        None,
        "0.0.9",
    )
    for i, (device, job, verdict, text) in enumerate(
        [
            ("GPU-aaaa", "job-1", "persistent", "replay: persistent"),
            ("GPU-aaaa", "job-2", "persistent", "replay: persistent again"),
            ("GPU-bbbb", "job-1", "match", "replay: match"),
            ("cpu:1@h17", "job-3", "intermittent", "replay: intermittent"),
            ("cpu:1@h17", "job-3", "match", "replay: match"),
        ]
    )
]


def _insert_raw(location: str, statement: str, rows: list[tuple]) -> None:
    """Rows written as an older sdcreplay wrote them, through the database's own driver."""
    if location.startswith("postgresql://"):
        import psycopg

        with psycopg.connect(location, autocommit=True) as connection:
            connection.cursor().executemany(statement.replace("?", "%s"), rows)
    else:
        with sqlite3.connect(location) as connection:
            connection.executemany(statement, rows)


def test_a_ledger_of_schema_version_1_is_migrated_with_every_record(ledger_url: str):
    with Ledger.open(ledger_url, migrate_to=1) as old:
        assert old.schema_version() == 1
    _insert_raw(ledger_url, V1_INSERT, V1_ROWS)

    with Ledger.open(ledger_url) as ledger:  # today's sdcreplay opens it: migrations 2, 3 run
        assert ledger.schema_version() == LATEST == 3
        records = ledger.records()
        ledger.append([Record("GPU-bbbb", "cuda:1", "h17", "screen", "failed", "screen: x")])
        after = ledger.records()
    assert [(r.device_id, r.job, r.verdict, r.evidence) for r in records] == [
        (device, job, verdict, text) for _, device, _, job, _, verdict, text, _, _ in V1_ROWS
    ]
    assert [r.finding for r in records] == [True, True, False, True, False]  # from the verdict
    assert [r.label for r in records] == ["GPU-aaaa", "GPU-aaaa", "GPU-bbbb", "cpu:1", "cpu:1"]
    assert [r.tool_version for r in records] == ["0.0.9"] * 5
    assert len(after) == 6 and after[-1].finding and after[-1].label == "cuda:1"
    assert [(r.incident, r.drill) for r in after] == [(None, None)] * 6


def test_a_version_2_drill_keeps_its_mark_as_a_drill(ledger_url: str):
    with Ledger.open(ledger_url, migrate_to=2):
        pass
    _insert_raw(
        ledger_url,
        V1_INSERT.replace("tool_version)", "tool_version, finding)").replace("?)", "?, ?)"),
        [
            (*V1_ROWS[0][:6], "screen: x [drill: op=aten.mm]", None, "0.1", 1),
            (*V1_ROWS[0][:6], "screen: x", None, "0.1", 1),
        ],
    )
    with Ledger.open(ledger_url) as ledger:
        assert [r.drill for r in ledger.records()] == ["marked in the evidence", None]


def test_a_ledger_from_a_newer_sdcreplay_is_refused(ledger_url: str):
    with Ledger.open(ledger_url):
        pass
    _insert_raw(
        ledger_url,
        "INSERT INTO schema_migrations (version, description, applied) VALUES (?, ?, ?)",
        [(LATEST + 1, "from the future", "2030-01-01")],
    )
    with pytest.raises(LedgerError, match=f"schema version {LATEST + 1}"):
        Ledger.open(ledger_url)


def unreachable(backend: str, tmp_path: Path) -> str:
    """A ledger nobody can write: a SQLite file under a regular file; a PostgreSQL port that
    nothing listens on."""
    if backend == "sqlite":
        (tmp_path / "a-file").write_text("not a directory")
        return str(tmp_path / "a-file" / "ledger.sqlite")
    import socket

    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens there
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"postgresql://nobody@127.0.0.1:{port}/ledger"


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_ledger_that_cannot_be_written_warns_and_the_library_goes_on(backend, tmp_path):
    location = unreachable(backend, tmp_path)
    record = Record("cpu:1@h", "cpu:1", "h", "screen", "failed", "screen: x", finding=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert note([record], location) is False
    (warning,) = [w for w in caught if issubclass(w.category, LedgerWarning)]
    assert "the verdict is not in the ledger" in str(warning.message)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_an_unreachable_ledger_warns_and_the_command_still_succeeds(
    backend, tmp_path, small_bundle, cli
):
    location = unreachable(backend, tmp_path)
    done = cli("replay", small_bundle, "-d", "cpu:0", "--json", env={"SDCREPLAY_LEDGER": location})
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["consensus"]["verdict"] == "correct"
    assert "Warning:" in done.stderr and "the verdict is not in the ledger" in done.stderr


def test_replay_appends_its_judged_devices_by_id_and_no_ledger_appends_nothing(
    ledger_url, small_bundle, cli
):
    env = {"SDCREPLAY_LEDGER": ledger_url}
    done = cli("replay", small_bundle, "-d", "cpu:0", "-d", "cpu:1", "--json", env=env)
    assert done.exit_code == 0, done.stderr
    rows = json.loads(done.stdout)["devices"]
    with Ledger.open(ledger_url) as ledger:
        records = ledger.records()
    assert [(r.device_id, r.label, r.command, r.verdict, r.finding) for r in records] == [
        (row["device_id"], row["device"], "replay", "match", False) for row in rows
    ]
    assert [row["device"] for row in rows] == ["cpu:0", "cpu:1"]
    assert rows[0]["device_id"] != rows[1]["device_id"]
    assert records[0].bundle == str(small_bundle.resolve())

    again = cli("replay", small_bundle, "-d", "cpu:0", "--no-ledger", env=env)
    assert again.exit_code == 0, again.stderr
    with Ledger.open(ledger_url) as ledger:
        assert len(ledger.records()) == 2
