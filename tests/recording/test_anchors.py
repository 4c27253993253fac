"""A production-level ring anchored on the job's own checkpoints, in a user's loop.

tests/checkpoint_loop.py is the user's script (started as a subprocess, as a job runs): a
``Recorder(ring=4, signature="boundary")`` told of each checkpoint it saves, the copy-free
UpdateDetector on every step, and a health check that asks for a bundle. The bundle must
reference the last checkpoint instead of copying state, replay ``correct`` from it, and
localize a fault planted on a replica exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, SMALL, TESTS, tiny_llama_recorder

from sdcreplay import Bundle, compare_logs, replay_on_device
from sdcreplay.errors import CheckpointError, SdcReplayError

FAULT = "kind=bitflip,op=aten.mm,module=2,phase=forward,step=11,index=37,bit=22,device=cpu:1"


def run_loop(tmp_path: Path, *args: str) -> dict:
    """The user's script, as a job starts it: its own process, the package from PYTHONPATH."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(TESTS / "checkpoint_loop.py"), "run.bundle", "ckpt", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def anchored(tmp_path_factory) -> tuple[Path, dict]:
    """14 steps, checkpoints after steps 4 and 9, the health check's bundle at step 12."""
    root = tmp_path_factory.mktemp("anchored")
    return root, run_loop(root)


def test_the_dump_references_the_last_checkpoint_instead_of_copying_state(anchored, cli):
    root, ran = anchored
    assert ran["alarms"] == []  # the copy-free detector: no false alarm on the clean run
    bundle = Bundle.open(root / ran["bundle"])
    state = bundle.manifest.state.to_json()
    checkpoint = (root / "ckpt" / "after-9.pt").resolve()
    assert (state["kind"], state["path"]) == ("checkpoint", str(checkpoint))
    assert "state.h5" in bundle.manifest.files  # the scheduler's state only, no model
    assert bundle.state_object_names == ["scheduler"]
    assert bundle.step_indices == [10, 11, 12]  # every step since the checkpoint
    assert (bundle.manifest.capture.level, bundle.verified, bundle.has_probe) == (
        "boundary",
        True,
        True,
    )
    trigger = bundle.manifest.trigger
    assert (trigger.source, trigger.anchor) == ("healthcheck", "checkpoint")
    assert trigger.note == (
        f"steps 10-12: every step since checkpoint {checkpoint} (saved before step 10)"
    )
    about = json.loads(cli("info", bundle.path, "--json").stdout)
    assert about["state"]["path"] == str(checkpoint) and about["signature_level"] == "boundary"


def test_the_anchored_bundle_replays_correct_and_a_replica_fault_is_localized_exactly(
    anchored, cli, tmp_path
):
    root, ran = anchored
    bundle = root / ran["bundle"]
    replayed = cli("replay", bundle, "-d", "cpu:0", "-d", "cpu:1", "--json")
    assert replayed.exit_code == 0, replayed.output
    assert json.loads(replayed.stdout)["consensus"]["verdict"] == "correct"
    faulty = cli("replay", bundle, "-d", "cpu:0", "-d", "cpu:1", "--inject", FAULT, "--json")
    consensus = json.loads(faulty.stdout)["consensus"]
    assert (consensus["verdict"], consensus["suspects"]) == ("persistent", ["cpu:1"])
    assert consensus["first_divergence"] == {"step": 11, "phase": "forward", "name": "forward:2"}
    bisected = cli(
        "bisect", bundle, "--suspect", "cpu:1", "--reference", "cpu:0", "--inject", FAULT,
        "--out", tmp_path / "report", "--json",
    )  # fmt: skip
    assert bisected.exit_code == 1, bisected.output  # a finding
    report = json.loads(bisected.stdout)
    assert (report["step"], report["phase"], report["module"], report["op"]) == (
        11,
        "forward",
        "2",
        "aten.mm.default",
    )
    assert report["elements"]["indices"] == [37] and report["bits"]["histogram"] == {"22": 1}


def test_a_checkpoint_that_changed_after_it_was_referenced_is_refused(tmp_path, cli):
    ran = run_loop(tmp_path, "--steps", "8", "--save-after", "4", "--alarm", "6")
    checkpoint = tmp_path / "ckpt" / "after-4.pt"
    saved = torch.load(checkpoint, weights_only=True)
    saved["model"]["0.weight"][0, 0] += 1.0  # the job wrote it again
    torch.save(saved, checkpoint)
    refused = cli("replay", tmp_path / ran["bundle"])
    assert refused.exit_code == 3, refused.output
    assert f"Error: checkpoint {checkpoint.resolve()} changed since the recording" in (
        refused.stderr
    )
    assert "Hint: Replay needs the exact checkpoint the window started from" in refused.stderr


def test_a_window_longer_than_its_bound_goes_on_from_copies_and_says_what_it_kept(tmp_path, cli):
    """A checkpoint before step 3, max_window=4: the window outgrows it at step 7; the ring
    copies the state every 2 steps from then on, and the dump at step 11 says so."""
    ran = run_loop(
        tmp_path, "--steps", "12", "--save-after", "2", "--alarm", "11",
        "--ring", "2", "--max-window", "4",
    )  # fmt: skip
    bundle = Bundle.open(tmp_path / ran["bundle"])
    assert bundle.manifest.state.kind == "embedded" and bundle.step_indices == [9, 10, 11]
    trigger = bundle.manifest.trigger
    checkpoint = (tmp_path / "ckpt" / "after-2.pt").resolve()
    assert trigger.anchor == "snapshot" and "anchor" not in trigger.to_json()  # the default
    assert trigger.note == (
        f"the window since checkpoint {checkpoint} (saved before step 3) outgrew max_window=4 "
        "steps at step 7; since then the ring copies the state every 2 steps until the next "
        "checkpoint, and this bundle holds steps 9-11 from its copy before step 9"
    )
    assert json.loads(cli("info", bundle.path, "--json").stdout)["trigger"]["note"] == trigger.note
    assert "│ window" in cli("info", bundle.path).stderr
    assert bundle.verified
    assert compare_logs(bundle.signature_log(), replay_on_device(bundle, "cpu")).identical


def test_a_checkpoint_that_does_not_hold_the_loops_state_fails_the_dumps_verification(
    tmp_path: Path,
):
    workload, recorder = tiny_llama_recorder(tmp_path / "r.bundle", ring=4)
    for index in range(3):
        with recorder.step(workload.get_batch(index)):
            workload.run_step(workload.get_batch(index))
        if index == 0:
            stale = {"model": workload.model.state_dict(), "optimizer": None}
            stale["optimizer"] = workload.optimizer.state_dict()
            torch.save(stale, tmp_path / "stale.pt")
    recorder.checkpoint_saved(tmp_path / "stale.pt")  # saved two steps ago
    with recorder.step(workload.get_batch(3)):
        workload.run_step(workload.get_batch(3))
    with pytest.warns(UserWarning, match="differs from the model's when checkpoint_saved"):
        path = recorder.dump("check")
    bundle = Bundle.open(path)
    assert bundle.verification.status == "failed"
    assert bundle.verification.problem.startswith("param:")
    recorder.close()


def test_checkpoint_saved_is_refused_where_it_anchors_nothing(tmp_path: Path):
    torch.save({"w": torch.zeros(1)}, tmp_path / "c.pt")
    workload, recorder = tiny_llama_recorder(tmp_path / "disk.bundle")
    with pytest.raises(SdcReplayError, match="anchors a ring buffer's window") as refused:
        recorder.checkpoint_saved(tmp_path / "c.pt")
    assert "ring=K" in refused.value.hint
    recorder.close()
    workload, ring = tiny_llama_recorder(tmp_path / "ring.bundle", ring=2)
    with ring.step(workload.get_batch(0)):
        with pytest.raises(SdcReplayError, match="inside a step's block"):
            ring.checkpoint_saved(tmp_path / "c.pt")
        workload.run_step(workload.get_batch(0))
    with pytest.raises(CheckpointError, match="does not exist"):
        ring.checkpoint_saved(tmp_path / "missing.pt")
    with pytest.raises(SdcReplayError, match="max_window=1 is not a number of steps"):
        tiny_llama_recorder(tmp_path / "x.bundle", kwargs=dict(SMALL), ring=2, max_window=1)
    ring.close()
