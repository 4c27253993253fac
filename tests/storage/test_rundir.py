"""A run directory is this process's alone: named by time, pid and a random part, made by one
``mkdir`` that fails on a name taken, retried, never reused, even when many processes make
theirs in the same instant; what --overwrite replaces is moved aside, never deleted; a
read-only place is known before anything is written there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdcreplay.errors import SdcReplayError
from sdcreplay.storage import rundir
from sdcreplay.storage.rundir import (
    claim,
    make_run_dir,
    set_aside,
    temporary_run_dir,
    writable_dir,
)

ROUNDS = int(os.environ.get("SDCREPLAY_STRESS_ROUNDS", "3"))
PROCESSES = 16
NAME = re.compile(r"\d{8}-\d{6}-(\d+)-[0-9a-f]{6}")

# Each process waits for the same instant, then makes 20 run directories as fast as it can.
MAKER = """
import sys, time
from sdcreplay.storage.rundir import make_run_dir
start = float(sys.argv[2])
while time.time() < start:
    pass
print("\\n".join(str(make_run_dir(sys.argv[1])) for _ in range(20)))
"""


def test_a_run_directory_is_new_named_by_time_pid_and_random(tmp_path: Path):
    first, second = make_run_dir(tmp_path / "logs"), make_run_dir(tmp_path / "logs")
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == tmp_path / "logs"
    match = NAME.fullmatch(first.name)
    assert match and int(match.group(1)) == os.getpid()
    assert make_run_dir(tmp_path, "r.", ".partial").name.startswith("r.")
    assert make_run_dir(tmp_path, "r.", ".partial").name.endswith(".partial")


def test_a_name_taken_is_retried_and_never_reused(tmp_path: Path, monkeypatch):
    parts = iter(["aaaaaa", "aaaaaa", "aaaaaa", "bbbbbb"])
    monkeypatch.setattr(rundir.secrets, "token_hex", lambda _: next(parts))
    monkeypatch.setattr(rundir.time, "strftime", lambda _: "20260101-000000")
    first = make_run_dir(tmp_path)
    (first / "a-result.json").write_text("mine")
    second = make_run_dir(tmp_path)  # two tries hit the first's name
    assert first.name.endswith("-aaaaaa") and second.name.endswith("-bbbbbb")
    assert (first / "a-result.json").read_text() == "mine" and not any(second.iterdir())


def test_a_run_directory_that_cannot_be_made_is_an_error_with_a_hint(tmp_path: Path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SdcReplayError) as info:
        make_run_dir(tmp_path / "a-file" / "logs")
    assert info.value.message.startswith(f"cannot create a run directory in {tmp_path}/a-file")
    assert "--logs" in info.value.hint and "log_dir" in info.value.python_hint


def test_many_processes_started_at_once_each_get_their_own(tmp_path: Path):
    for round_number in range(ROUNDS):
        parent = tmp_path / f"round{round_number}"
        start = time.time() + 1.5  # every process is waiting by then
        makers = [
            subprocess.Popen(
                [sys.executable, "-c", MAKER, str(parent), str(start)],
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(PROCESSES)
        ]
        made = [line for maker in makers for line in maker.communicate(timeout=120)[0].split()]
        assert all(maker.returncode == 0 for maker in makers)
        assert len(made) == len(set(made)) == PROCESSES * 20
        assert sorted(made) == sorted(str(path) for path in parent.iterdir())
        assert len({NAME.fullmatch(Path(p).name).group(1) for p in made}) == PROCESSES


def test_set_aside_moves_a_directory_or_a_file_and_replaces_nothing(tmp_path: Path):
    report = tmp_path / "report"
    (report / "ticket").mkdir(parents=True)
    (report / "ticket" / "ticket.json").write_text("{}")
    moved = set_aside(report)
    assert not report.exists() and moved.parent == tmp_path
    assert re.fullmatch(r"report\.old-\d{8}-\d{6}-\d+-[0-9a-f]{6}", moved.name)
    assert (moved / "ticket" / "ticket.json").read_text() == "{}"
    report.mkdir()
    assert set_aside(report) != moved and (moved / "ticket" / "ticket.json").is_file()
    (tmp_path / "notes.txt").write_text("mine")
    assert set_aside(tmp_path / "notes.txt").read_text() == "mine"


def test_writable_dir_sees_a_file_in_the_way_and_a_missing_parent(tmp_path: Path):
    assert writable_dir(tmp_path) and writable_dir(tmp_path / "not" / "yet")
    (tmp_path / "a-file").write_text("")
    assert not writable_dir(tmp_path / "a-file") and not writable_dir(tmp_path / "a-file" / "x")


def test_writable_dir_refuses_a_read_only_mount(tmp_path: Path, read_only):
    read_only_dir = tmp_path / "ro"
    read_only_dir.mkdir()
    read_only(read_only_dir)
    assert not writable_dir(read_only_dir) and not writable_dir(read_only_dir / ".screen")
    with pytest.raises(OSError):
        (read_only_dir / "probe").mkdir()  # what the check predicts


def test_a_temporary_run_directory_lies_under_the_system_temp(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(rundir.tempfile, "tempdir", None)
    made = temporary_run_dir("screen")
    assert made.parent == tmp_path / "sdcreplay-screen" and made.is_dir()


HOLDER = """
import sys
from sdcreplay.storage.rundir import claim
claim(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
"""


def test_a_directory_a_person_named_is_held_by_one_process_at_a_time(tmp_path: Path):
    logs = tmp_path / "logs"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(logs)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(SdcReplayError) as info:
            claim(logs)
        assert info.value.message == (
            f"{logs} is being written by another sdcreplay run (pid {holder.pid})"
        )
        assert "--logs" in info.value.hint and "log_dir" in info.value.python_hint
    finally:
        holder.communicate("", timeout=60)  # it ends, and the kernel releases its lock
    assert claim(logs) == logs and claim(logs) == logs  # this process may name it again
