"""The records a command's JSON makes: one per judged device, findings only for evidence
against it, and an online alarm accuses a device only when another computed otherwise."""

from __future__ import annotations

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
