"""``--json`` stays JSON: what a workload prints (Python's ``print`` and a C-level write to
descriptor 1, as it builds and in its step) goes to stderr, in the command's own process and
in its device processes; stdout is the one JSON object (real subprocesses of the CLI)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import SMALL

PRINTING_WORKLOAD = f"""
import os

from sdcreplay.workload.tiny_llama import make_workload as tiny_llama


def make_workload(seed=0):
    print("number of parameters: 0.10M")  # as nanoGPT says at build
    os.write(1, b"C-level: built\\n")
    workload = tiny_llama(seed=seed, **{SMALL!r})
    loss_fn = workload.loss_fn

    def printing_loss(model, batch):
        print("iter: loss printed by the loop")
        os.write(1, b"C-level: a step\\n")
        return loss_fn(model, batch)

    workload.loss_fn = printing_loss
    return workload
"""

PLANTED = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=5,bit=22"


def sdcreplay(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """The console script as a person runs it: a process of its own, stdout a pipe."""
    command = [sys.executable, "-c", "from sdcreplay.cli import main; main()", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=cwd)


@pytest.fixture(scope="module")
def printing_bundle(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """A two-step recording of a workload that prints, by ``record --json``."""
    where = tmp_path_factory.mktemp("printing")
    (where / "printing.py").write_text(PRINTING_WORKLOAD)
    done = sdcreplay(
        "record", f"{where / 'printing.py'}:make_workload", "--steps", "2",
        "--out", str(where / "run.bundle"), "--json", cwd=where,
    )  # fmt: skip
    return where, done


def only_json(done: subprocess.CompletedProcess) -> dict:
    """stdout is one JSON object, and the workload's prints went to stderr."""
    document = json.loads(done.stdout)
    assert "number of parameters" not in done.stdout and "C-level" not in done.stdout
    return document


def test_record_json_is_json(printing_bundle):
    where, done = printing_bundle
    assert done.returncode == 0, done.stderr
    assert only_json(done)["schema"] == "sdcreplay.record/1"
    assert "number of parameters: 0.10M" in done.stderr
    assert "C-level: built" in done.stderr and "C-level: a step" in done.stderr


def test_ops_json_is_json(printing_bundle):
    where, _ = printing_bundle
    done = sdcreplay("ops", "run.bundle", "--step", "1", "--op", "aten.mm", "--json", cwd=where)
    assert done.returncode == 0, done.stderr
    listing = only_json(done)
    assert listing["schema"].startswith("sdcreplay.ops/")
    assert "iter: loss printed by the loop" in done.stderr and "C-level: a step" in done.stderr


def test_replay_and_bisect_json_are_json(printing_bundle):
    """The device processes print too: into their logs, never onto the command's stdout."""
    where, _ = printing_bundle
    replayed = sdcreplay(
        "replay", "run.bundle", "-d", "cpu:0", "-d", "cpu:1",
        "--inject", f"{PLANTED},device=cpu:1", "--json", cwd=where,
    )  # fmt: skip
    assert replayed.returncode == 1, replayed.stderr
    consensus = only_json(replayed)["consensus"]
    assert (consensus["verdict"], consensus["suspects"]) == ("persistent", ["cpu:1"])
    bisected = sdcreplay(
        "bisect", "run.bundle", "--suspect", "cpu:1", "--reference", "cpu:0", "--step", "1",
        "--inject", f"{PLANTED},device=cpu:1", "--out", "report", "--json", cwd=where,
    )  # fmt: skip
    assert bisected.returncode == 1, bisected.stderr
    report = only_json(bisected)
    assert (report["step"], report["op"], report["module"]) == (
        1,
        "aten.mm.default",
        "layers.0.attn.wq",
    )
