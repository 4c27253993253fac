"""The records a command's JSON makes: one per judged device, findings only for evidence
against it, and an online alarm accuses a device only when another computed otherwise."""

from __future__ import annotations

from sdcreplay.ledger.verdicts import alarm_record, records_for

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
    from conftest import SMALL, tiny_llama_recorder

    from sdcreplay.ledger.identity import identify
    from sdcreplay.ledger.store import Ledger

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
