"""Drills fire in the loop's own steps: ``Recorder(inject=...)`` and ``SDCREPLAY_INJECT``
corrupt what examples/train_loop.py records as a defective device would; the manifest names
the specs that fired, and only those; a spec that matches nothing is said by name."""

from __future__ import annotations

import importlib.util
import warnings
from pathlib import Path

import pytest

import sdcreplay
from sdcreplay.bundle.reader import Bundle
from sdcreplay.capture.fault_spec import FaultSpec
from sdcreplay.errors import FaultSpecError
from sdcreplay.recording.drill import UnmatchedFaultWarning
from tests.conftest import REPO, SMALL

NAN_IN_STEP_1 = "kind=nan,op=aten.addmm,step=1,phase=forward"
FIRED = [str(FaultSpec.parse(NAN_IN_STEP_1))]  # as the manifest writes a spec
NOWHERE = "kind=bitflip,op=aten.addmm,module=no.such.module,step=1"


def train_loop():
    """examples/train_loop.py as a module (its ``make_workload`` and ``get_batch``)."""
    spec = importlib.util.spec_from_file_location("train_loop", REPO / "examples/train_loop.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_loop(path: Path, inject=(), steps: int = 3) -> list[float]:
    """The example's loop as its main() runs it, recorded with ``inject``; its losses."""
    loop = train_loop()
    kwargs = {"seed": 0, "hidden": 16}
    workload = loop.make_workload(**kwargs)
    rec = sdcreplay.Recorder(
        path,
        workload=f"{REPO / 'examples/train_loop.py'}:make_workload",
        workload_kwargs=kwargs,
        model=workload.model,
        optimizer=workload.optimizer,
        state=workload.state,
        inject=inject,
    )
    losses = []
    with rec:
        for step in range(steps):
            batch = loop.get_batch(step)
            with rec.step(batch):
                losses.append(float(workload.train_step(batch)))
    return losses


@pytest.fixture(scope="module")
def clean_and_drilled(tmp_path_factory) -> tuple[Path, list[float], Path, list[float]]:
    where = tmp_path_factory.mktemp("drill")
    clean = record_loop(where / "clean.bundle")
    drilled = record_loop(where / "drill.bundle", inject=[NAN_IN_STEP_1])
    return where / "clean.bundle", clean, where / "drill.bundle", drilled


def test_a_recorders_fault_corrupts_the_loops_own_step(clean_and_drilled):
    clean_path, clean, drill_path, drilled = clean_and_drilled
    assert drilled[0] == clean[0]  # step 0 is before the fault
    assert clean[1] == clean[1] and drilled[1] != drilled[1]  # the NaN reached the loss
    recorded = Bundle.open(drill_path).signature_log().steps
    assert (
        dict(recorded[0])["loss"] == dict(Bundle.open(clean_path).signature_log().steps[0])["loss"]
    )
    assert Bundle.open(drill_path).injected_faults == FIRED
    assert Bundle.open(clean_path).injected_faults == []


def test_replay_of_a_drilled_recording_accuses_the_recording(clean_and_drilled):
    _, _, drill_path, _ = clean_and_drilled
    report = sdcreplay.replay_devices(drill_path, ["cpu:0", "cpu:1"], ledger=False)
    assert (report.consensus.verdict, report.consensus.suspects) == (
        "recording_suspect",
        ["record"],
    )
    assert report.consensus.first_divergence.brief()["step"] == 1
    assert report.recorded_faults == FIRED


def test_a_spec_that_matches_nothing_warns_by_name_and_makes_no_drill(tmp_path: Path, monkeypatch):
    """Through SDCREPLAY_INJECT, as a deployment's drill sets it."""
    monkeypatch.setenv("SDCREPLAY_INJECT", NOWHERE)
    with pytest.warns(UnmatchedFaultWarning, match="no.such.module") as said:
        losses = record_loop(tmp_path / "b.bundle", steps=2)
    assert len(said) == 1 and "aten.addmm.default under" in str(said[0].message)
    listing = f"`sdcreplay ops {tmp_path / 'b.bundle'} --step 1` lists them all"
    assert listing in str(said[0].message)
    assert all(loss == loss for loss in losses)
    assert Bundle.open(tmp_path / "b.bundle").injected_faults == []


def test_the_env_var_fires_in_the_loop_too(tmp_path: Path, monkeypatch, clean_and_drilled):
    _, _, _, drilled = clean_and_drilled
    monkeypatch.setenv("SDCREPLAY_INJECT", NAN_IN_STEP_1)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedFaultWarning)
        losses = record_loop(tmp_path / "b.bundle", steps=2)
    assert losses[0] == drilled[0] and losses[1] != losses[1]
    assert Bundle.open(tmp_path / "b.bundle").injected_faults == FIRED


def test_record_refuses_a_spec_that_matches_nothing_without_also_warning(tmp_path: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedFaultWarning)
        with pytest.raises(FaultSpecError, match="matches no operator call"):
            sdcreplay.record(
                "builtin:tiny-llama", tmp_path / "b.bundle", steps=2, kwargs=dict(SMALL),
                inject=[NOWHERE],
            )  # fmt: skip
    assert Bundle.open(tmp_path / "b.bundle").injected_faults == []
