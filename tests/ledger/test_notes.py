"""Whatever SDCREPLAY_LEDGER says, the ledger never breaks a command nor its budget: a value
that names no ledger (malformed, an unknown scheme, a bad port), a server that refuses or
never answers, a read-only path, a file that is not SQLite: one warning, and the verdict and
exit code stand; nothing is created where the value did not name a ledger."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from sdcreplay.fleet.corpus import add_tickets
from sdcreplay.ledger.notes import LedgerWarning, note
from sdcreplay.ledger.schema import Record
from sdcreplay.ledger.store import CONNECT_SECONDS, Ledger

RECORD = Record("cpu:1@h", "cpu:1", "h", "screen", "failed", "screen: x")
WAIT = 0.7  # under psycopg's shortest connect timeout (2 s): the deadline must be our own


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port on 127.0.0.1 that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # accept() raises once the server is closed
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()
    for connection in held:
        connection.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def values(tmp_path: Path, silent: int) -> dict[str, tuple[str, str]]:
    """name -> (SDCREPLAY_LEDGER value, what its one warning says)."""
    (tmp_path / "not-sqlite.db").write_bytes(b"a text file, not a database\n" * 100)
    return {
        "malformed URL": ("postgresql://[bad", "'postgresql://[bad' is not a well-formed URL"),
        "unknown scheme": ("mysql://host/db", "names the scheme 'mysql', which the ledger does"),
        "one slash": ("postgresql:/host", "'postgresql:/host' is not a PostgreSQL URL"),
        "port out of range": (
            "postgresql://u:pw@127.0.0.1:99999/db",
            "'postgresql://u:***@127.0.0.1:99999/db' is not a well-formed URL (Port out of range",
        ),
        "port not a number": ("postgresql://u@127.0.0.1:x/db", "could not be cast to integer"),
        "nothing listens": (f"postgresql://u@127.0.0.1:{_free_port()}/db", "postgresql://u@"),
        "silent server": (
            f"postgresql://u:pw@127.0.0.1:{silent}/db",
            f"the ledger postgresql://u:***@127.0.0.1:{silent}/db did not answer in 0.7 s",
        ),
        "read-only path": ("/proc/sdcreplay/ledger.sqlite", "cannot open the ledger /proc/"),
        "not SQLite": (str(tmp_path / "not-sqlite.db"), "file is not a database"),
        "sqlite with two slashes": ("sqlite://ledger.sqlite", "is not a SQLite URL"),
    }


CASES = [
    "malformed URL",
    "unknown scheme",
    "one slash",
    "port out of range",
    "port not a number",
    "nothing listens",
    "silent server",
    "read-only path",
    "not SQLite",
    "sqlite with two slashes",
]


@pytest.mark.parametrize("case", CASES)
def test_every_ledger_value_that_names_no_usable_ledger_warns_once_by_the_deadline(
    case, tmp_path, silent_server, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # a value taken as a relative path would show up here
    value, said = values(tmp_path, silent_server)[case]
    before = sorted(tmp_path.iterdir())
    # Loading libpq holds the interpreter's lock (a loaded machine: up to a second), which no
    # deadline can cut: loaded first, so that what is timed is the ledger's wait.
    import psycopg  # noqa: F401

    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert note([RECORD], value, wait=WAIT) is False
    took = time.monotonic() - started
    (warning,) = [w for w in caught if issubclass(w.category, LedgerWarning)]
    assert said in str(warning.message) and "the verdict is not in the ledger" in str(
        warning.message
    )
    assert ":pw@" not in str(warning.message)  # never the password
    assert took < WAIT + 0.25, took  # the deadline is ours, to the tenth of a second
    assert sorted(tmp_path.iterdir()) == before


@pytest.mark.parametrize("case", ["malformed URL", "unknown scheme", "silent server"])
def test_a_command_under_any_ledger_value_keeps_its_verdict_and_exit_code(
    case, small_bundle, tmp_path, silent_server, monkeypatch, cli
):
    monkeypatch.chdir(tmp_path)
    value, said = values(tmp_path, silent_server)[case]
    done = cli("replay", small_bundle, "-d", "cpu:0", "--json", env={"SDCREPLAY_LEDGER": value})
    assert done.exit_code == 0, done.stderr
    assert json.loads(done.stdout)["consensus"]["verdict"] == "correct"
    assert done.stderr.count("Warning:") == 1 and said.split(" did not")[0] in done.stderr
    assert not (tmp_path / "mysql:").exists()


def test_screen_ends_by_its_budget_whatever_the_ledger_server_does(
    tickets, tmp_path, silent_server, run_exe
):
    """Within its budget, and a silent server costs it the server's 5 s, not the budget."""
    corpus = tmp_path / "corpus"
    add_tickets(corpus, tickets[:1])
    value = f"postgresql://u@127.0.0.1:{silent_server}/db"
    budget = 45  # 20 s suffices on an idle machine; a loaded 2-core one needs ~30 s to start
    done = run_exe(
        "screen",
        corpus,
        "-d",
        "cpu:0",
        "--budget",
        str(budget),
        "--json",
        env={"SDCREPLAY_LEDGER": value},
    )
    assert done.returncode == 0, done.stderr  # passed: a record the silent server must take
    report = json.loads(done.stdout)
    # From the process's start (/proc) to the result: the ledger's wait ends by budget - 1 s.
    # (The interpreter's exit after it, the forkserver's shutdown, is not the ledger's.)
    assert report["within_budget"] and report["seconds"] <= budget, report["seconds"]
    assert done.stderr.count("did not answer in") == 1  # once (another warning: a drill corpus)
    # a silent server gets what it gets from any command, not the rest of a long budget
    assert f"did not answer in {CONNECT_SECONDS} s" in done.stderr


def test_devices_read_a_read_only_ledger_and_refuse_one_that_does_not_exist(tmp_path, cli):
    """A ledger file and directory without write permission (for root, which may write
    anyway, the ledger's bytes are what must not change) is listed, shown and exported."""
    ledger = tmp_path / "ro" / "ledger.sqlite"
    with Ledger.open(str(ledger)) as opened:
        opened.append([RECORD])
    content = ledger.read_bytes()
    ledger.chmod(0o444)
    ledger.parent.chmod(0o555)
    try:
        for args in (["list"], ["show", "cpu:1@h"], ["export"]):
            done = cli("devices", *args, "--ledger", str(ledger))
            assert done.exit_code == 0, done.stderr
        listed = cli("devices", "list", "--ledger", str(ledger), "--json").stdout
        assert [row["id"] for row in json.loads(listed)["devices"]] == ["cpu:1@h"]
        assert ledger.read_bytes() == content
    finally:
        ledger.parent.chmod(0o755)

    missing = tmp_path / "nowhere" / "ledger.sqlite"
    for args in (["list"], ["show", "cpu:1"], ["export"], ["clear", "cpu:1", "--reason", "x"]):
        done = cli("devices", *args, "--ledger", str(missing))
        assert done.exit_code == 3, done.stdout
        assert f"Error: the ledger {missing} does not exist" in done.stderr
        assert "Hint: No verdict has been recorded there" in done.stderr
    assert not missing.parent.exists()
    refused = cli("devices", "list", "--ledger", "mysql://host/db")
    assert refused.exit_code == 3 and "names the scheme 'mysql'" in refused.stderr
