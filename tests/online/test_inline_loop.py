"""The online detectors in a loop written inline (script mode, no train_step function):
examples/detect_script.py run as a person runs it, with a fault planted in the recording
device; and what ReplayCheck cannot do there, refused with a hint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sdcreplay
from sdcreplay.bundle.reader import Bundle
from sdcreplay.online import ConfigurationError, ReplayCheck, UpdateDetector
from tests.conftest import TESTS

SPEC = "kind=bitflip,op=aten.mm,module=inp,phase=backward,step=12,nth=0,index=5,bit=30"


@pytest.mark.slow
def test_an_inline_loop_alarms_at_the_planted_step_dumps_and_trains_on(tmp_path: Path, cli):
    """16 steps of an inline script-mode loop with a ring of 4 and an UpdateDetector; bit 30
    of one element of step 12's `inp` weight gradient flipped on the recording device. The
    only alarm is step 12 (clean steps before and after it raise none; training went on to
    the end); its bundle holds the alarmed step last, verifies, is a drill, and two healthy
    replicas agree with each other against the record."""
    for name in ("detect_script.py", "train_script.py"):
        shutil.copy(TESTS.parent / "examples" / name, tmp_path / name)
    out = tmp_path / "alarm.bundle"
    done = subprocess.run(
        [sys.executable, "detect_script.py", "--out", "alarm.bundle", "--steps", "16"]
        + ["--inject", SPEC],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "alarm: step 12: grad_norm_jump, grad:inp.weight -> unresolved (bundle alarm.bundle)",
        "16 steps judged, alarms at [12]",
    ]
    assert "the update was applied (an inline step runs once)" in done.stderr
    bundle = Bundle.open(out)
    trigger = bundle.manifest.trigger
    assert (trigger.source, trigger.step, trigger.ring) == ("UpdateDetector", 12, 4)
    assert trigger.reason == "UpdateDetector: step 12 grad_norm_jump, grad:inp.weight (unresolved)"
    assert bundle.step_indices == [8, 9, 10, 11, 12] and bundle.verified
    assert bundle.manifest.workload.is_script and bundle.injected_faults == [SPEC]
    result = cli("replay", out, "-d", "cpu:0", "-d", "cpu:1", "--timeout", "120", "--json")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert report["consensus"]["verdict"] == "recording_suspect"
    assert [device["verdict"] for device in report["devices"]] == ["match", "match"]


def _loop_pieces() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_replay_check_without_a_train_step_says_what_it_can_do_inline() -> None:
    """A ReplayCheck re-executes the step in this process: an inline body runs once."""
    model, optimizer = _loop_pieces()
    with pytest.raises(ConfigurationError) as refused:
        ReplayCheck(model=model, optimizer=optimizer)
    assert refused.value.message == (
        "ReplayCheck re-executes a step in this process (a reference and its replays), and an "
        "inline loop's body runs once: it needs the step as a function"
    )
    assert "`with detector.step():`" in refused.value.hint
    assert "sdcreplay replay BUNDLE --device" in refused.value.hint


def test_an_inline_detector_cannot_run_a_step_nor_be_nested_in_the_recorders(tmp_path) -> None:
    model, optimizer = _loop_pieces()
    detector = UpdateDetector(model=model, optimizer=optimizer)
    with pytest.raises(ConfigurationError, match="given no train_step"):
        detector.run_step(torch.ones(1, 4))
    detector.close()
    rec = sdcreplay.Recorder(tmp_path / "r.bundle", model=model, optimizer=optimizer, ring=2)
    detector = UpdateDetector(model=model, optimizer=optimizer, recorder=rec)
    with rec.step(), pytest.raises(ConfigurationError, match="inside the recorder's open step"):
        with detector.step():
            pass
    detector.close()
    rec.close()


@pytest.mark.parametrize("when", ["before_update", "after_update"])
def test_inline_steps_are_judged_like_driven_ones(when: str) -> None:
    """The same clean steps, inline and through run_step, give the detector the same losses
    and gradient norms, and the same metrics (no alarm)."""
    seen = []
    for inline in (True, False):
        model, optimizer = _loop_pieces()

        def train_step(x: torch.Tensor, model=model, optimizer=optimizer) -> torch.Tensor:
            loss = model(x).square().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        detector = UpdateDetector(
            model=model, optimizer=optimizer, when=when, train_step=None if inline else train_step
        )
        torch.manual_seed(1)
        observations = []
        for _ in range(12):
            x = torch.randn(3, 4)
            if inline:
                with detector.step():
                    train_step(x)
            else:
                detector.run_step(x)
            observations.append(detector._baselines._first_losses[-1])
        seen.append((observations, detector.metrics()["detections"], detector.next_step))
        detector.close()
    assert seen[0] == seen[1] and seen[0][1:] == (0, 12)
