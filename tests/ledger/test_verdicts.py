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
        "alarm: step 10 grad_spike, grad_norm_jump, grad (3 parameters: tok_embeddings.weight, "
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


@pytest.fixture(scope="module")
def drill_bundle(tmp_path_factory) -> Path:
    """Recorded once through the Python API (`record(..., inject=...)`) with the fault in the
    recording device: a drill bundle, whose record is the odd one out."""
    from conftest import preserved_global_state

    from sdcreplay import record

    out = tmp_path_factory.mktemp("drill") / "drill.bundle"
    with preserved_global_state():
        record("builtin:tiny-llama", out, steps=2, seed=0, kwargs=dict(SMALL), inject=[DRILL])
    return out


def test_a_recorder_marks_its_faults_and_sdcreplay_inject_in_the_manifest(tmp_path, monkeypatch):
    """`Recorder(inject=...)` and SDCREPLAY_INJECT in force while recording mark the bundle a
    drill with the specs that fired (one planted in step 1 fires; SDCREPLAY_INJECT's, for a
    step 5 never recorded, is said by name and marks nothing); a bundle recorded without them
    has no such field (old bundles load the same)."""
    import json

    from sdcreplay.bundle.reader import Bundle
    from sdcreplay.recording.drill import UnmatchedFaultWarning

    later = "kind=nan,op=aten.mm,phase=forward,step=5"
    monkeypatch.setenv("SDCREPLAY_INJECT", later)
    workload, recorder = tiny_llama_recorder(tmp_path / "drill.bundle", inject=[DRILL])
    for index in range(2):
        batch = workload.get_batch(index)
        with recorder.step(batch):
            workload.run_step(batch)
    with pytest.warns(UnmatchedFaultWarning, match="step=5"):
        path = recorder.close()
    assert Bundle.open(path).injected_faults == [DRILL]
    monkeypatch.delenv("SDCREPLAY_INJECT")
    workload, recorder = tiny_llama_recorder(tmp_path / "clean.bundle")
    with recorder.step(batch):
        workload.run_step(batch)
    clean = recorder.close()
    assert "injected_faults" not in json.loads((clean / "manifest.json").read_text())
    assert Bundle.open(clean).injected_faults == []


def test_every_record_of_a_bundle_recorded_with_faults_is_a_drill(
    drill_bundle, tmp_path, cli, run_exe, monkeypatch
):
    """A bundle recorded with a fault (`record(..., inject=...)`): `info` says so; its replay
    (Python and command line), a bisect, the minimize of that report, the ticket, its corpus
    entry and a screen of it are drills in the ledger, each naming the recorded fault; the
    recording device is in the `drill` state, which no export drains."""
    import json

    from sdcreplay import replay_devices
    from sdcreplay.fleet.states import judge

    ledger = str(tmp_path / "ledger.sqlite")
    env = {"SDCREPLAY_LEDGER": ledger}
    recorded = f"recorded with {DRILL}"
    shown = cli("info", drill_bundle)
    assert shown.exit_code == 0, shown.stderr
    assert "drill" in shown.stderr and "recorded with injected faults" in shown.stderr
    assert json.loads(cli("info", drill_bundle, "--json").stdout)["injected_faults"] == [DRILL]

    monkeypatch.setenv("SDCREPLAY_LEDGER", ledger)
    monkeypatch.setenv("SLURM_JOB_ID", "3001")
    report = replay_devices(drill_bundle, ["cpu:0", "cpu:1"], log_dir=tmp_path / "logs")
    assert report.consensus is not None and report.consensus.verdict == "recording_suspect"
    assert report.to_json()["recorded_faults"] == [DRILL]
    monkeypatch.delenv("SLURM_JOB_ID")
    replayed = cli(
        "replay",
        drill_bundle,
        "-d",
        "cpu:0",
        "-d",
        "cpu:2",
        "--json",
        env={**env, "SLURM_JOB_ID": "3002"},
    )
    assert replayed.exit_code == 1, replayed.stderr
    spec = f"{DRILL},device=cpu:1"
    found = cli(
        "bisect", drill_bundle, "--suspect", "cpu:1", "--step", "1", "--inject", spec,
        "--out", tmp_path / "run.bisect", "--json", env={**env, "SLURM_JOB_ID": "3003"},
    )  # fmt: skip
    assert found.exit_code == 1, found.stderr
    assert json.loads(found.stdout)["recorded_faults"] == [DRILL]
    made = cli(
        "minimize", tmp_path / "run.bisect", "--trials", "20", "--good-trials", "2",
        "--inject", spec, "--out", tmp_path / "ticket", env={**env, "SLURM_JOB_ID": "3004"},
    )  # fmt: skip
    assert made.exit_code == 1, made.stderr
    ticket = json.loads((tmp_path / "ticket" / "ticket.json").read_text())
    assert (ticket["drill"], ticket["injected_faults"], ticket["recorded_faults"]) == (
        True,
        [spec],
        [DRILL],
    )
    assert f"({spec}; {recorded})" in (tmp_path / "ticket" / "ticket.md").read_text()
    added = cli("corpus", "add", tmp_path / "corpus", tmp_path / "ticket")
    assert added.exit_code == 0, added.stderr
    assert f"[drill: {spec}; {recorded}: it tests the tooling, not a device]" in " ".join(
        added.stderr.split()
    )
    screened = run_exe(  # its own process: the budget counts from the process's start
        "screen", tmp_path / "corpus", "-d", "cpu:0", "--budget", "120",
        env={**env, "SLURM_JOB_ID": "3005"}, timeout=300,
    )  # fmt: skip
    assert screened.returncode == 0, screened.stderr

    with Ledger.open(ledger) as opened:
        records = opened.records()
    assert [(r.command, r.label, r.verdict, r.job, r.drill) for r in records] == [
        ("replay", "cpu:0", "match", "3001", recorded),
        ("replay", "cpu:1", "match", "3001", recorded),
        ("replay", "cpu", "recording_suspect", "3001", recorded),
        ("replay", "cpu:0", "match", "3002", recorded),
        ("replay", "cpu:2", "match", "3002", recorded),
        ("replay", "cpu", "recording_suspect", "3002", recorded),
        ("bisect", "cpu:1", "divergence", "3003", f"{spec}; {recorded}"),
        ("minimize", "cpu:1", "reproduced", "3004", f"{spec}; {recorded}"),
        ("screen", "cpu:0", "passed", "3005", f"{spec}; {recorded}"),
    ]
    for record in records:
        assert record.evidence.endswith(f" [drill: {record.drill}]"), record
    recorder = judge([r for r in records if r.label == "cpu"])
    assert recorder.state == "drill" and recorder.findings == []


def test_record_inject_and_record_nproc_mark_the_bundle_and_its_job_replay_is_a_drill(
    tmp_path, cli
):
    """`record --inject` (with SDCREPLAY_INJECT in force too) marks the bundle, `info` shows it;
    a job `record --nproc 2` with a fault in rank 1's recording marks the job, and every record
    of its replay is a drill."""
    import json

    from conftest import SMALL_ARGS

    ledger = str(tmp_path / "ledger.sqlite")
    first, second = (
        DRILL.replace("step=1", "step=0").replace("index=5", f"index={i}") for i in (5, 6)
    )
    done = cli(
        "record", "builtin:tiny-llama", "--steps", "1", *SMALL_ARGS, "--inject", first,
        "--out", tmp_path / "one.bundle", env={"SDCREPLAY_INJECT": second},
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    shown = cli("info", tmp_path / "one.bundle")
    assert "│ drill" in shown.stderr and "recorded with injected" in shown.stderr, shown.stderr
    described = json.loads(cli("info", tmp_path / "one.bundle", "--json").stdout)
    assert described["injected_faults"] == [first, second]
    job = tmp_path / "job.bundle"
    fault = "kind=bitflip,op=aten.mm,phase=backward,step=1,nth=0,index=3,bit=22,rank=1"
    done = cli(
        "record", "builtin:tiny-llama", "--nproc", "2", "--steps", "2", *SMALL_ARGS,
        "--inject", fault, "--out", job,
    )  # fmt: skip
    assert done.exit_code == 0, done.stderr
    assert json.loads(cli("info", job, "--json").stdout)["injected_faults"] == [fault]
    devices = [arg for n in range(4) for arg in ("-d", f"cpu:{n}")]
    replayed = cli(
        "replay", job, *devices, "--timeout", "60", "--json",
        env={"SDCREPLAY_LEDGER": ledger, "SLURM_JOB_ID": "4001"},
    )  # fmt: skip
    assert replayed.exit_code == 1, replayed.stderr
    assert json.loads(replayed.stdout)["recorded_faults"] == [fault]
    with Ledger.open(ledger) as opened:
        records = opened.records()
    assert [(r.label, r.rank, r.verdict, r.drill) for r in records] == [
        (f"cpu:{n}", rank, "match", f"recorded with {fault}")
        for rank, labels in ((0, (0, 2)), (1, (1, 3)))
        for n in labels
    ]
