"""A device's state follows from its records by the documented rules, and clearing counts
only until the next finding."""

from __future__ import annotations

import json

from sdcreplay.fleet.states import by_device, judge
from sdcreplay.ledger.schema import Record
from sdcreplay.ledger.store import Ledger


def record(verdict: str, command: str = "replay", job: str = "job-1", **more) -> Record:
    return Record(
        "GPU-1", "cuda:3", "h17", command, verdict, f"{command}: {verdict}", job=job, **more
    )


def test_no_finding_is_healthy():
    state = judge([record("match"), record("passed", "screen")])
    assert (state.state, state.reason) == ("healthy", "no finding in 2 records")


def test_one_finding_is_suspect_and_findings_of_one_job_stay_suspect():
    state = judge([record("match"), record("persistent"), record("divergence", "bisect")])
    assert state.state == "suspect"
    assert state.reason == "2 findings from one incident (job-1): bisect: divergence"


def test_findings_from_two_independent_jobs_confirm():
    state = judge([record("persistent", job="job-1"), record("failed", "screen", job="job-2")])
    assert (state.state, state.reason) == (
        "confirmed",
        "findings from 2 independent incidents: job-1, job-2",
    )


def test_one_incident_judged_in_several_jobs_stays_suspect():
    one = "bundle:" + "ab" * 32
    state = judge(
        [
            record("persistent", job="1001", incident=one),
            record("divergence", "bisect", job="1002", incident=one),
            record("reproduced", "minimize", job="1003", incident=one, ci_low=0.01),
        ]
    )
    assert (state.state, state.reason) == (
        "suspect",
        f"3 findings from one incident ({one}): minimize: reproduced",
    )
    other = record("failed", "screen", job="1004", incident="screen:1004")
    assert judge([*state.records, other]).state == "confirmed"


def test_drill_findings_are_no_evidence():
    drill = record("persistent", job="d1", drill="op=aten.mm.default,bit=22")
    state = judge([drill, record("failed", "screen", job="d2", drill="op=aten.mm.default")])
    assert (state.state, state.findings, len(state.drills)) == ("drill", [], 2)
    assert state.reason == (
        "2 drill findings (injected faults: op=aten.mm.default), no evidence: screen: failed"
    )
    assert judge([drill, record("persistent", job="real")]).state == "suspect"


def test_a_reproducer_whose_interval_is_disjoint_from_the_reference_confirms():
    above = record("reproduced", "minimize", ci_low=0.996, ci_high=1.0, reference_ci_high=0.0038)
    assert judge([above]).state == "confirmed"
    overlapping = record("reproduced", "minimize", ci_low=0.0001, reference_ci_high=0.0038)
    assert judge([overlapping]).state == "suspect"  # the interval touches the reference's


def test_clearing_forgets_earlier_findings_until_a_new_one():
    cleared = [record("persistent"), record("cleared", "clear")]
    assert judge(cleared).state == "cleared"
    assert judge([*cleared, record("match")]).state == "cleared"
    assert judge([*cleared, record("failed", "screen", job="job-9")]).state == "suspect"


def test_devices_are_listed_in_the_order_first_seen():
    other = Record("cpu:1@h", "cpu:1", "h", "screen", "passed", "screen: passed")
    assert [d.id for d in by_device([record("match"), other, record("persistent")])] == [
        "GPU-1",
        "cpu:1@h",
    ]


def test_clear_and_show_through_the_command_line(tmp_path, cli):
    location = str(tmp_path / "ledger.sqlite")
    with Ledger.open(location) as ledger:
        ledger.append([record("persistent", identity={"model": "NVIDIA H100"})])
    env = {"SDCREPLAY_LEDGER": location}
    refused = cli("devices", "clear", "GPU-1", "--reason", " ", env=env)
    assert refused.exit_code == 3 and "Error: a clearing needs a reason" in refused.stderr
    done = cli("devices", "clear", "cuda:3", "--reason", "RMA: board replaced", "--json", env=env)
    assert done.exit_code == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (shown["id"], shown["state"], shown["model"]) == ("GPU-1", "cleared", "NVIDIA H100")
    assert shown["cleared"]["evidence"] == "cleared: RMA: board replaced"
    history = json.loads(cli("devices", "show", "GPU-1", "--json", env=env).stdout)
    assert [r["command"] for r in history["records"]] == ["replay", "clear"]
    unknown = cli("devices", "show", "GPU-2", env=env)
    assert unknown.exit_code == 3 and "has no device 'GPU-2'" in unknown.stderr
