"""A 4-rank DDP job replayed as 2 nodes x 2 ranks: two launches of the real console script on
127.0.0.1, each running its ranks under torch's elastic agent and c10d rendezvous, each with
its own log directory (no file shared between the nodes but the job bundle). Node 0 prints
the report and writes the ledger's records once; both exit with its verdict's code. A node
killed mid-replay: the other exits 3 naming it, within the timeout, and nothing is left
running; a node that never comes is named too.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from conftest import process_ended

FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=0,rank=3,index=3,bit=20"
DEVICES = {0: ["cpu:0", "cpu:1"], 1: ["cpu:2", "cpu:3"]}


@pytest.fixture(scope="module")
def job(builtin_job) -> Path:
    """The run's shared 4-rank DDP job (conftest ``builtin_job``)."""
    return builtin_job("ddp", 4).out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Launches:
    """One launch per node of ``sdcreplay replay JOB --nnodes 2 ...`` on this machine."""

    def __init__(self, exe: str, job: Path, tmp_path: Path, *options: str):
        self.tmp, self.port = tmp_path, _free_port()
        self.env = {**os.environ, "SDCREPLAY_LEDGER": f"sqlite:///{tmp_path / 'ledger.db'}"}
        self.env.pop("SDCREPLAY_DEBUG", None)
        self.command = [exe, "replay", str(job), "--nnodes", "2", "--nproc-per-node", "2"]
        self.command += ["--rdzv-endpoint", f"127.0.0.1:{self.port}", *options, "--json"]
        self.processes: dict[int, subprocess.Popen] = {}

    def logs(self, node: int) -> Path:
        return self.tmp / f"node{node}-logs"

    def start(self, node: int, *extra: str) -> subprocess.Popen:
        labels = [word for label in DEVICES[node] for word in ("-d", label)]
        words = [*self.command, "--node-rank", str(node), *labels, "--logs", str(self.logs(node))]
        self.processes[node] = subprocess.Popen(
            [*words, *extra],
            cwd=self.tmp,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        return self.processes[node]

    def finish(self, node: int, timeout: float = 240) -> tuple[int, str, str]:
        out, err = self.processes[node].communicate(timeout=timeout)
        return self.processes[node].returncode, out, err

    def records(self) -> list[tuple]:
        """The ledger's records (none where nothing was written: no ledger at all)."""
        if not (self.tmp / "ledger.db").is_file():
            return []
        with sqlite3.connect(self.tmp / "ledger.db") as ledger:
            return sorted(ledger.execute("SELECT label, rank, verdict FROM records"))


def _both(launches: Launches) -> dict[int, tuple[int, str, str]]:
    for node in (1, 0):  # node 1 first: it waits for node 0's store
        launches.start(node)
    return {node: launches.finish(node) for node in (0, 1)}


def test_a_clean_job_is_correct_on_two_nodes(job, sdcreplay_exe, tmp_path):
    launches = Launches(sdcreplay_exe, job, tmp_path)
    ended = _both(launches)
    assert [ended[node][0] for node in (0, 1)] == [0, 0], ended[0][2][-3000:] + ended[1][2][-3000:]
    report = json.loads(ended[0][1])
    assert report["verdict"] == "correct" and report["world_size"] == 4
    devices = [run["device"] for rank in report["ranks"] for run in rank["devices"]]
    assert devices == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    # node 1's logs came to node 0 through the rendezvous store, into node 0's own directory
    logs = [Path(path) for rank in report["ranks"] for path in rank["devices"][0]["logs"]]
    assert all(launches.logs(0) in path.parents and path.is_file() for path in logs)
    assert json.loads(ended[1][1]) == {
        "schema": "sdcreplay.replay-node/1", "bundle": str(job), "node_rank": 1, "nnodes": 2,
        "ranks": [2, 3], "devices": ["cpu:2", "cpu:3"], "reported_by": 0,
        "verdict": "correct", "exit_code": 0,
    }  # fmt: skip
    assert launches.records() == [
        ("cpu:0", 0, "match"), ("cpu:1", 1, "match"), ("cpu:2", 2, "match"),
        ("cpu:3", 3, "match"),
    ]  # fmt: skip


def test_same_batch_on_two_nodes_names_the_faulty_rank(job, sdcreplay_exe, tmp_path):
    launches = Launches(sdcreplay_exe, job, tmp_path, "--same-batch", "--inject", FAULT)
    ended = _both(launches)
    assert [ended[node][0] for node in (0, 1)] == [1, 1], ended[0][2][-3000:] + ended[1][2][-3000:]
    report = json.loads(ended[0][1])
    assert report["mode"] == "same_batch" and report["verdict"] == "persistent"
    assert [odd["rank"] for odd in report["odd_ranks"]] == [3]
    assert report["suspects"] == ["cpu:3"]
    assert [rank["verdict"] for rank in report["ranks"]] == [
        "correct", "correct", "correct", "persistent",
    ]  # fmt: skip
    assert json.loads(ended[1][1])["verdict"] == "persistent"
    assert launches.records() == [
        ("cpu:0", 0, "match"), ("cpu:1", 1, "match"), ("cpu:2", 2, "match"),
        ("cpu:3", 3, "persistent"),
    ]  # fmt: skip


def _tree(pid: int) -> set[int]:
    try:
        return {pid} | {child.pid for child in psutil.Process(pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def test_a_node_killed_mid_replay_ends_the_other_naming_it(job, sdcreplay_exe, tmp_path):
    launches = Launches(sdcreplay_exe, job, tmp_path, "--timeout", "20")
    node1, node0 = launches.start(1), launches.start(0)
    started = launches.logs(1) / "replica0" / "replay-rank2.task.json.pid"
    deadline = time.monotonic() + 120
    while not started.is_file() and time.monotonic() < deadline and node1.poll() is None:
        time.sleep(0.1)
    assert started.is_file(), "node 1's ranks never started"
    processes = _tree(node0.pid) | _tree(node1.pid)
    killed = time.monotonic()
    node1.send_signal(signal.SIGKILL)
    code, _, err = launches.finish(0, timeout=120)
    took = time.monotonic() - killed
    launches.finish(1)
    assert code == 3, err[-3000:]
    assert "Error: node 1 (ranks 2-3) on cpu:2, cpu:3 is lost" in err, err[-3000:]
    assert "Hint: " in err
    assert took < 2 * 20 + 15, took  # the collective's timeout, or the node's silence
    deadline = time.monotonic() + 15
    while not all(process_ended(pid) for pid in processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in processes if not process_ended(pid)] == []
    assert launches.records() == []  # no verdict, no record


def test_a_node_that_never_comes_is_named(job, sdcreplay_exe, tmp_path):
    launches = Launches(sdcreplay_exe, job, tmp_path, "--rdzv-timeout", "2")
    launches.start(0)
    code, out, err = launches.finish(0, timeout=120)
    assert code == 3
    error = json.loads(out)
    assert (error["kind"], error["exit_code"]) == ("NodeError", 3)
    assert error["message"] == (
        f"node 1 (ranks 2-3) never arrived at the rendezvous 127.0.0.1:{launches.port} within 2 s"
    )
    assert "--rdzv-timeout" in error["hint"]


@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--nnodes", "2", "--nproc-per-node", "2"], "go together"),
        (["--node-rank", "1"], "go together"),
        (["--nnodes", "2", "--nproc-per-node", "3", "--rdzv-endpoint", "h:1"], "the job has 4"),
        (["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h"], "is not HOST:PORT"),
        (
            ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", "h:1", "-d", "cpu:0"],
            "1 device labels for --nproc-per-node 2",
        ),
    ],
)
def test_a_placement_that_cannot_be_is_refused(job, cli, options, said):
    result = cli("replay", job, *options)
    assert result.exit_code == 3
    assert said in result.stderr and "Hint:" in result.stderr
