"""Comparable by evidence: a replica votes on a record only if its kernel probe matches the
record's, and the recording device is accused only on the whole case.

Another kind of machine is simulated on this one with ``SDCREPLAY_OTHER_MACHINE``: the device
processes it names compute ``aten.mm`` with other bits, in the probe and in the step alike, as
a replica on another CPU or GPU model would.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALL, preserved_global_state

from sdcreplay.bundle.manifest import PROBE
from sdcreplay.bundle.reader import Bundle
from sdcreplay.recording.drive import record

MM = "aten.mm.default"
RECORD_FAULT = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=3"


@pytest.fixture
def bundle(small_bundle: Path) -> Path:
    """The session's small bundle (recorded with verification on, so with a probe)."""
    return small_bundle


def _replay(cli, bundle: Path, *args: str, env: dict | None = None) -> tuple[int, dict]:
    done = cli("replay", bundle, *args, "--json", "--logs", bundle.parent / "logs", env=env)
    return done.exit_code, json.loads(done.stdout)


def _replicas(n: int) -> list[str]:
    return [arg for i in range(n) for arg in ("-d", f"cpu:{i}")]


def test_a_recording_keeps_a_probe_of_its_first_steps_kernels(bundle: Path):
    opened = Bundle.open(bundle)
    assert opened.verified and PROBE in opened.manifest.files
    probe = opened.probe()
    assert probe is not None and probe["schema"] == "sdcreplay.probe/1"
    ops = {call["op"] for call in probe["calls"]}
    assert {
        MM,
        "aten.embedding.default",
        "aten.nll_loss_forward.default",
        "aten.sqrt.default",
    } <= ops
    assert all(call["digest"] for call in probe["calls"])


def test_replicas_whose_probe_matches_judge_as_before(bundle: Path, cli):
    code, report = _replay(cli, bundle, *_replicas(2))
    assert (code, report["consensus"]["verdict"]) == (0, "correct")
    for device in report["devices"]:
        assert device["probe"]["matched"] and device["probe"]["ran"] > 20
        assert device["fingerprint_differences"] == []


def test_replicas_on_another_kind_of_machine_are_incomparable_and_accuse_no_one(bundle, cli):
    code, report = _replay(cli, bundle, *_replicas(2), env={"SDCREPLAY_OTHER_MACHINE": MM})
    assert code == 3
    consensus = report["consensus"]
    assert (consensus["verdict"], consensus["suspects"]) == ("incomparable", [])
    assert [d["verdict"] for d in report["devices"]] == ["incomparable", "incomparable"]
    assert report["record"]["verdict"] != "persistent"  # the record is not accused either
    for device in report["devices"]:
        first = device["fingerprint_differences"][0]
        assert first.startswith(f"probe: {MM} [") and first.endswith("gives other bits here")
        assert device["probe"]["differing"][0]["kernel"].startswith(MM)
    assert MM in consensus["advice"] and "doctor --against" in consensus["advice"]


def test_an_incomparable_replay_says_why_there_is_no_verdict_and_what_to_do(bundle, cli):
    done = cli("replay", bundle, *_replicas(2), env={"SDCREPLAY_OTHER_MACHINE": MM})
    assert done.exit_code == 3
    error = next(line for line in done.stderr.splitlines() if line.startswith("Error:"))
    assert error.startswith(
        "Error: no verdict: no replica ran on a machine comparable with the recording's "
        f"(cpu:0: probe: {MM} ["
    )
    hint = done.stderr[done.stderr.index("Hint:") :]
    assert "the recording's kind of machine" in hint
    assert f"sdcreplay doctor --against {bundle}" in " ".join(hint.split())


def test_of_three_replicas_the_two_comparable_ones_judge_and_the_third_is_named(bundle, cli):
    env = {"SDCREPLAY_OTHER_MACHINE": f"{MM}@cpu:2"}
    code, report = _replay(cli, bundle, *_replicas(3), env=env)
    assert (code, report["consensus"]["verdict"], report["consensus"]["suspects"]) == (
        0,
        "correct",
        [],
    )
    verdicts = {d["device"]: d["verdict"] for d in report["devices"]}
    assert verdicts == {"cpu:0": "match", "cpu:1": "match", "cpu:2": "incomparable"}
    assert list(report["consensus"]["incomparable"]) == ["cpu:2"]
    assert report["consensus"]["incomparable"]["cpu:2"][0].startswith(f"probe: {MM}")


def test_a_real_fault_on_a_replica_is_still_persistent_with_the_probe_on(bundle, cli):
    fault = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=3,bit=20"
    code, report = _replay(cli, bundle, *_replicas(3), "--inject", f"{fault},device=cpu:1")
    assert (code, report["consensus"]["verdict"], report["consensus"]["suspects"]) == (
        1,
        "persistent",
        ["cpu:1"],
    )
    assert all(d["probe"]["matched"] for d in report["devices"])  # data-dependent: probe passes
    assert report["consensus"]["first_divergence"] == {
        "step": 1,
        "phase": "forward",
        "name": "forward:layers.0.attn.wq",
    }


def _recorded_with_fault(tmp_path: Path, verify: bool | str) -> Path:
    out = tmp_path / "bad.bundle"
    with preserved_global_state():
        record(
            "builtin:tiny-llama",
            out,
            steps=2,
            kwargs=dict(SMALL),
            inject=[RECORD_FAULT],
            verify=verify,
        )
    return out


def test_a_fault_while_recording_is_recording_suspect_on_the_whole_case(tmp_path, cli):
    bundle = _recorded_with_fault(tmp_path, verify=True)
    code, report = _replay(cli, bundle, *_replicas(2))
    assert (code, report["consensus"]["verdict"], report["consensus"]["suspects"]) == (
        1,
        "recording_suspect",
        ["record"],
    )
    assert report["consensus"]["missing"] == []


def test_one_comparable_replica_is_not_the_whole_case(tmp_path, cli):
    """The other two replicas run on "another machine": the one left ties with the record."""
    bundle = _recorded_with_fault(tmp_path, verify=True)
    env = {"SDCREPLAY_OTHER_MACHINE": f"{MM}@cpu:1,{MM}@cpu:2"}
    code, report = _replay(cli, bundle, *_replicas(3), env=env)
    consensus = report["consensus"]
    assert (code, consensus["verdict"], consensus["suspects"]) == (1, "undecided", [])
    assert sorted(consensus["incomparable"]) == ["cpu:1", "cpu:2"]
    assert "replay on at least 1 more device of the recording's kind" in consensus["advice"]


def test_an_unverified_bundle_whose_replays_all_differ_is_undecided_with_the_reason(tmp_path, cli):
    bundle = _recorded_with_fault(tmp_path, verify=False)
    assert not Bundle.open(bundle).has_probe  # no re-execution, no probe
    code, report = _replay(cli, bundle, *_replicas(2))
    consensus = report["consensus"]
    assert (code, consensus["verdict"], consensus["suspects"]) == (1, "undecided", [])
    assert [d["verdict"] for d in report["devices"]] == ["match", "match"]
    assert consensus["missing"][0].startswith("the recording is unverified: a difference")
    assert consensus["missing"][1].startswith("the bundle holds no kernel probe")
    assert "accuses the recording device only with the whole case" in consensus["advice"]


def test_doctor_against_a_bundle_says_whether_this_machine_can_judge_it(bundle, cli):
    done = cli("doctor", "--against", bundle, "--device", "cpu:0", "--json")
    assert done.exit_code == 0, done.output
    report = json.loads(done.stdout)
    assert (report["schema"], report["comparable"], report["probe"]["matched"]) == (
        "sdcreplay.doctor/1",
        True,
        True,
    )
    other = cli(
        "doctor", "--against", bundle, "--device", "cpu:0", env={"SDCREPLAY_OTHER_MACHINE": MM}
    )
    assert other.exit_code == 1
    shown = other.stdout + other.stderr
    assert f"{MM} [" in shown and "incomparable: cpu:0 cannot judge" in shown


def test_doctor_against_a_bundle_without_a_probe_is_refused(tmp_path, cli):
    bundle = _recorded_with_fault(tmp_path, verify=False)
    done = cli("doctor", "--against", bundle)
    assert done.exit_code == 3
    assert "holds no kernel probe" in done.stderr and "Hint: Record the bundle again" in done.stderr


@pytest.mark.parametrize("step", [[], ["--step", "1"]], ids=["found-by-replay", "given"])
def test_bisect_refuses_a_reference_that_computes_unlike_the_suspect(bundle, cli, step):
    fault = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=3"
    done = cli(
        "bisect", bundle, "--suspect", "cpu:1", "--reference", "cpu:0", *step,
        "--inject", f"{fault},device=cpu:1", "--out", bundle.parent / "report",
        env={"SDCREPLAY_OTHER_MACHINE": f"{MM}@cpu:0"},
    )  # fmt: skip
    assert done.exit_code == 3, done.output
    assert "Error: the reference cpu:0 does not compute like cpu:1: probe: aten.mm" in done.stderr
    assert "doctor --against" in done.stderr
