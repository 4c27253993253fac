"""The records a command's JSON makes: one per judged device, findings only for evidence
against it, and an online alarm accuses a device only when another computed otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SMALL, tiny_llama_recorder

from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.operators import OperatorMode
from sdcreplay.ledger.identity import identify
from sdcreplay.ledger.store import Ledger
from sdcreplay.ledger.verdicts import alarm_record, records_for
from sdcreplay.online.second_opinion import ReplicaOpinion
from sdcreplay.online.stopping import PersistentFaultError
from sdcreplay.online.update_detector import UpdateDetector
from sdcreplay.workload.definition import build_workload

SUSPECT = {"id": "GPU-1", "label": "cuda:3", "host": "h17", "kind": "cuda", "model": "H100"}


def test_a_bisect_divergence_is_a_finding_with_operator_element_and_bits(tmp_path):
    result = {
        "schema": "sdcreplay.bisect/1",
        "verdict": "divergence",
        "bundle": str(tmp_path / "run.bundle"),
        "report": str(tmp_path / "run.bundle.bisect"),
        "step": 1,
        "phase": "forward",
        "module": "layers.0.attn.wq",
        "op": "aten.mm.default",
        "isolated": "kernel",
        "elements": {"indices": [5], "total": 512},
        "bits": {"histogram": {"22": 1}},
        "inject": [],
        "identities": {"suspect": SUSPECT},
    }
    (record,) = records_for(result)
    assert (record.device_id, record.label, record.finding, record.operator) == (
        "GPU-1",
        "cuda:3",
        True,
        "aten.mm.default",
    )
    assert (record.element, record.bits, record.iteration) == ("5", "22", 1)
    assert record.evidence == (
        "bisect: step 1 forward layers.0.attn.wq aten.mm.default element 5 of 512 bit 22 (kernel)"
    )
    assert records_for({**result, "verdict": "no_divergence"}) == []


def test_a_minimize_records_its_interval_and_the_references():
    result = {
        "schema": "sdcreplay.minimize/1",
        "reproduced": True,
        "op": "aten.mm.default",
        "trials": 1000,
        "failures": 1000,
        "rate": 1.0,
        "ci95": [0.9962, 1.0],
        "reference_ci95": [0.0, 0.0038],
        "first_mismatch": {"index": 5},
        "bits": {"histogram": {"3": 1, "22": 1}},
        "site": {"step": 1},
        "inject": ["kind=bitflip,op=aten.mm"],
        "report": "/runs/x.bundle.bisect",
        "ticket": "/runs/x.bundle.bisect/ticket",
        "identities": {"device": SUSPECT},
    }
    (record,) = records_for(result)
    assert (record.verdict, record.finding, record.bits) == ("reproduced", True, "3,22")
    assert (record.ci_low, record.reference_ci_high, record.bundle) == (
        0.9962,
        0.0038,
        "/runs/x.bundle",
    )
    assert record.evidence.endswith("[drill: kind=bitflip,op=aten.mm]")


def test_an_alarm_accuses_only_when_a_second_opinion_contradicts():
    alone = alarm_record("cpu", 7, "persistent", "update:w")
    assert (alone.verdict, alone.finding, alone.iteration) == ("alarm (persistent)", False, 7)
    contradicted = alarm_record("cpu", 7, "persistent", "update:w", contradicted_by="cpu:1")
    assert (contradicted.verdict, contradicted.finding) == ("persistent", True)


def test_a_schema_that_judges_no_device_makes_no_record():
    assert records_for({"schema": "sdcreplay.info/1"}) == []


def test_a_ring_dump_is_noted_in_the_ledger_as_history(tmp_path, monkeypatch):
    location = str(tmp_path / "ledger.sqlite")
    monkeypatch.setenv("SDCREPLAY_LEDGER", location)
    workload, recorder = tiny_llama_recorder(tmp_path / "run.bundle", SMALL, ring=2)
    for index in range(3):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.run_step(batch)
    held = recorder.ring_steps
    path = recorder.dump("loss spike", source="UpdateDetector")
    recorder.close()
    with Ledger.open(location) as ledger:
        (record,) = ledger.records()
    assert (record.device_id, record.command, record.verdict, record.finding) == (
        identify("cpu").id,
        "dump",
        "dumped",
        False,
    )
    assert (record.evidence, record.report, record.iteration) == (
        "dump: loss spike",
        str(path.resolve()),
        held[0],
    )


def test_update_detector_alarms_are_noted_and_accuse_only_when_another_device_disagrees(
    tmp_path, monkeypatch
):
    """The transient alarm of tests/online (a bias planted in one execution of step 10) is
    history; the sticky one another device computes otherwise is a finding."""
    location = str(tmp_path / "ledger.sqlite")
    monkeypatch.setenv("SDCREPLAY_LEDGER", location)
    bias = "kind=bias,op=aten.mm,module=layers.0.attn.wq,phase=backward,step=10,index=69,scale=1e4"

    def small():
        return build_workload("builtin:tiny-llama", dict(SMALL))

    def train(spec: str, **options) -> None:
        workload = small()
        detector = UpdateDetector(workload, warmup=5, spike_steps=5, **options)
        for i in range(12):
            injector = Injector(parse_specs([spec], include_env=False), "cpu")
            with OperatorMode(workload.model, workload.optimizer, [injector], i):
                detector.run_step(workload.get_batch(i))

    train(bias + ",nth=0")
    with pytest.raises(PersistentFaultError):
        train(bias, second_opinion=ReplicaOpinion(small))
    with Ledger.open(location) as ledger:
        records = ledger.records()
    assert [(r.device_id, r.command, r.verdict, r.finding, r.iteration) for r in records] == [
        (identify("cpu").id, "alarm", "alarm (transient)", False, 10),
        (identify("cpu").id, "alarm", "persistent", True, 10),
    ]
    assert records[1].evidence == (
        "alarm: step 10 grad_spike, grad (3 parameters: tok_embeddings.weight, "
        "layers.0.attention_norm.weight, layers.0.attn.wq.weight) -> persistent, "
        "cpu computed otherwise"
    )


DRILL = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=5,bit=22"


def test_one_planted_fault_is_one_incident_marked_as_a_drill_in_every_record(
    small_bundle, tmp_path, cli
):
    """replay, bisect and minimize of one bundle, each in a scheduler job of its own (the fault
    once by --inject, once by SDCREPLAY_INJECT): every record names the bundle's identity and
    its report, and is marked a drill; the device's state is `drill`, and were the fault real,
    the replay and bisect would be one incident: suspect, not confirmed. bisect --no-ledger
    appends nothing, not even its step-finding replays'."""
    import dataclasses
    import json

    from sdcreplay.bundle.reader import Bundle
    from sdcreplay.capture.signature import read_signature_log
    from sdcreplay.fleet.states import judge

    ledger = str(tmp_path / "ledger.sqlite")
    spec = f"{DRILL},device=cpu:1"
    env = {"SDCREPLAY_LEDGER": ledger}
    incident = "bundle:" + Bundle.open(small_bundle).manifest.manifest_sha256

    quiet = cli(
        "bisect",
        small_bundle,
        "--suspect",
        "cpu:1",
        "--inject",
        spec,
        "--out",
        tmp_path / "quiet.bisect",
        "--no-ledger",
        env=env,
    )
    assert quiet.exit_code == 1, quiet.stderr
    assert not (tmp_path / "ledger.sqlite").exists()  # no record, no ledger

    replayed = cli(
        "replay",
        small_bundle,
        "-d",
        "cpu:0",
        "-d",
        "cpu:1",
        "--json",
        env={**env, "SLURM_JOB_ID": "1001", "SDCREPLAY_INJECT": spec},
    )
    assert replayed.exit_code == 1, replayed.stderr
    replay = json.loads(replayed.stdout)
    assert replay["incident"] == incident
    for row in replay["devices"]:  # the replay logs name it too
        assert [read_signature_log(Path(log)).meta["incident"] for log in row["logs"]] == [incident]
    found = cli(
        "bisect",
        small_bundle,
        "--suspect",
        "cpu:1",
        "--step",
        "1",
        "--inject",
        spec,
        "--out",
        tmp_path / "run.bisect",
        "--json",
        env={**env, "SLURM_JOB_ID": "1002"},
    )
    assert found.exit_code == 1, found.stderr
    assert json.loads(found.stdout)["incident"] == incident
    made = cli(
        "minimize",
        tmp_path / "run.bisect",
        "--trials",
        "20",
        "--good-trials",
        "2",
        "--inject",
        spec,
        "--out",
        tmp_path / "ticket",
        "--json",
        env={**env, "SLURM_JOB_ID": "1003"},
    )
    assert made.exit_code == 1, made.stderr
    assert json.loads((tmp_path / "ticket" / "ticket.json").read_text())["incident"] == incident

    with Ledger.open(ledger) as opened:
        records = opened.records()
    assert [(r.command, r.label, r.verdict, r.job) for r in records] == [
        ("replay", "cpu:0", "match", "1001"),
        ("replay", "cpu:1", "persistent", "1001"),
        ("bisect", "cpu:1", "divergence", "1002"),
        ("minimize", "cpu:1", "reproduced", "1003"),
    ]
    for record in records:
        assert record.incident == incident
        assert record.drill == spec and record.evidence.endswith(f" [drill: {spec}]")
        assert record.report, record
    device = judge([r for r in records if r.label == "cpu:1"])
    assert device.state == "drill" and device.findings == []
    # As if real: the replay and bisect, in two jobs, are one incident (minimize's interval,
    # disjoint from the reference's, would confirm by the reproducer rule alone).
    as_if_real = judge([dataclasses.replace(r, drill=None) for r in device.records[:2]])
    assert as_if_real.state == "suspect", as_if_real.reason
    assert as_if_real.reason.startswith(f"2 findings from one incident ({incident}): bisect")
