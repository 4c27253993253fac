"""Ranks under PyTorch's elastic launcher: a collective across them, a rank that dies in the
middle of one, a rank that hangs; every rank is reported and nothing waits forever.

The ranks replay a single-process recording of a workload whose every loss call all-reduces a
tensor of ones across the job (tests/misbehaving.py), so each rank meets the others in a
collective at every step; one rank misbehaves there on purpose.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SMALL, TESTS, process_ended

from sdcreplay.bundle.reader import Bundle
from sdcreplay.capture.signature import read_signature_log
from sdcreplay.compare.logs import compare_logs
from sdcreplay.replay import launch
from sdcreplay.replay.session import run_replay_task

MISBEHAVING = TESTS / "misbehaving.py"
WORKLOAD = f"{MISBEHAVING}:make_workload"


@pytest.fixture(scope="module")
def collective_bundles(tmp_path_factory) -> dict[str, Path]:
    """2-step recordings (in this process, so no collective and no misbehaviour) of the workload
    set to misbehave on cpu:1 at its second step in each way."""
    from conftest import preserved_global_state

    from sdcreplay import record

    root = tmp_path_factory.mktemp("launch")
    bundles = {}
    for misbehave in ("none", "os_exit", "hang"):
        out = root / f"{misbehave}.bundle"
        kwargs = {**SMALL, "misbehave": misbehave, "collective": True, "at_step": 1}
        with preserved_global_state():
            record(WORKLOAD, out, steps=2, seed=0, kwargs=kwargs)
        bundles[misbehave] = out
    return bundles


def replay_ranks(bundle: Path, work: Path, labels: list[str], timeout: float = 60.0):
    return launch.run_ranks(
        "replay",
        run_replay_task,
        labels,
        lambda rank: {"bundle": str(bundle), "repeats": 1, "log_dir": str(work)},
        work,
        timeout=timeout,
    )


def test_ranks_meet_in_a_collective_and_reproduce_the_record(collective_bundles, tmp_path):
    bundle = collective_bundles["none"]
    results = replay_ranks(bundle, tmp_path, ["cpu:0", "cpu:1"])
    record = Bundle.open(bundle).signature_log()
    for rank in (0, 1):
        value = results[rank].value
        assert value is not None, results[rank].error
        log = read_signature_log(Path(value["logs"][0]))
        assert compare_logs(record, log).identical
        # Each rank's own stdout file: both steps' all-reduce summed the two ranks' ones.
        stdout = (tmp_path / f"replay-rank{rank}.stdout.txt").read_text()
        assert stdout.count("all_reduce of ones: 2") == 2, stdout


def test_a_rank_that_dies_mid_collective_is_reported_and_the_others_end(
    collective_bundles, tmp_path
):
    results = replay_ranks(collective_bundles["os_exit"], tmp_path, ["cpu:0", "cpu:1", "cpu:2"])
    dead = results[1].error
    assert dead is not None
    assert dead.exit_status == 7
    assert dead.message == "rank 1 (cpu:1) exited with status 7"
    assert dead.log == str(tmp_path / "replay-rank1.stderr.txt")
    assert (dead.stderr_tail, dead.hint) == (  # no "stderr lines above" where there are none
        "",
        "It ended without a word on stderr (os._exit, or a crash in native code); run it again "
        "alone to see whether it ends the same way.",
    )
    for rank in (0, 2):  # waiting for rank 1 in the all-reduce: ended, not left hanging
        error = results[rank].error
        assert error is not None
        assert error.message.startswith(f"rank {rank} (cpu:{rank})")
        assert not error.timed_out


def test_a_rank_that_hangs_is_killed_after_the_timeout_and_the_others_end(
    collective_bundles, tmp_path
):
    results = replay_ranks(collective_bundles["hang"], tmp_path, ["cpu:0", "cpu:1"], timeout=4)
    errors = {rank: result.error for rank, result in results.items()}
    assert all(error is not None for error in errors.values())
    hung = [rank for rank, error in errors.items() if error and error.timed_out]
    assert len(hung) == 1  # the job was stuck: one rank was killed, the launcher ended the other
    error = errors[hung[0]]
    assert error is not None and error.timed_out == 4
    assert error.exit_status == -9
    assert "made no progress for 4 s (at step 1 (repeat 0))" in error.message


def test_rank_labels_are_one_kind_of_device():
    assert launch.backend_for(["cpu", "cpu:3"]) == "gloo"
    assert launch.backend_for(["cuda:0", "cuda:1"]) == "nccl"
    with pytest.raises(launch.LaunchError, match="mix device types"):
        launch.backend_for(["cpu:0", "cuda:1"])


def test_the_watchdog_kills_the_rank_that_issued_fewest_collectives_not_the_last_to_beat(
    tmp_path,
):
    """The race CI met: rank 0 issued its collective and waits; slower rank 1 beat after it
    (its step began) and then stalled before its call. The oldest beat is rank 0's, a healthy
    rank; the rank the job waits for is the one that issued fewer collectives."""
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])]
    sleepers.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]))
    try:
        ranks = []
        beats = {0: ("step 1, gloo:all_reduce 3", 4, 100.0), 1: ("step 1 (repeat 0)", 3, 101.0)}
        for rank, (where, issued, when) in beats.items():
            stem = tmp_path / f"replay-rank{rank}"
            state = launch._Rank(Path(f"{stem}.alive"), 0.0, rank, f"cpu:{rank}", stem)
            state.alive.write_text(f"{where}\n{issued}")
            os.utime(state.alive, (when, when))
            Path(f"{state.task}.pid").write_text(str(sleepers[rank].pid))
            ranks.append(state)
        assert ranks[0].last_progress() < ranks[1].last_progress()
        assert [state.collectives_issued() for state in ranks] == [4, 3]
        watchdog = launch._Watchdog(ranks, timeout=0.2)
        watchdog.start()
        assert sleepers[1].wait(timeout=30) == -9
        watchdog.stop()
        assert watchdog.killed == (1, "step 1 (repeat 0)")
        assert sleepers[0].poll() is None  # the healthy rank was left alone
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()


ORPHAN = """
import os, sys, time
from sdcreplay.replay import processes
supervisor = os.getpid()
ended_r, ended_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(ended_w)
    os.read(ended_r, 1)  # EOF: the supervisor has ended, before the request below
    time.sleep(0.2)
    processes.die_with_parent(supervisor)
    open(sys.argv[1], "w").write("outlived its supervisor")
    os._exit(0)
print(child, flush=True)
os._exit(0)
"""


def test_a_ranks_process_whose_supervisor_ended_before_it_asked_to_die_with_it_dies(tmp_path):
    """A rank's process, forked by its supervisor, may run its first line only after the
    supervisor was killed (the command interrupted under load): adopted by the reaper by then,
    it must not take the reaper for its parent and live on, holding the job's pipes."""
    survived = tmp_path / "survived"
    done = subprocess.run(
        [sys.executable, "-c", ORPHAN, str(survived)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    child = int(done.stdout)
    for _ in range(200):
        if process_ended(child):
            break
        time.sleep(0.05)
    assert not survived.exists()
    assert process_ended(child)


STARTS_A_SERVER = """
from multiprocessing import forkserver
from sdcreplay.replay import processes
processes.process_context("sdcreplay.replay.worker")
print(forkserver._forkserver._forkserver_pid, flush=True)
"""


def test_the_forkserver_ends_with_the_command_even_while_it_still_imports(tmp_path):
    """The server reads its clients' pipe only once it has imported torch (seconds under load,
    ^C blocked): a command that ends before then (interrupted) takes it along at once, instead
    of leaving it to finish the import and notice."""
    done = subprocess.run(
        [sys.executable, "-c", STARTS_A_SERVER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    server = int(done.stdout)
    assert process_ended(server)
