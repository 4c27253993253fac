"""export prints what a person would run to drain suspect devices (and runs nothing): Slurm's
scontrol line per node, Kubernetes taints, JSON, and Megatron's tracker lines."""

from __future__ import annotations

import json
import re

import pytest

from sdcreplay.ledger.schema import Record
from sdcreplay.ledger.store import Ledger

GPU3 = dict(device_id="GPU-3f2a", label="cuda:3", host="h17.cluster")


@pytest.fixture
def env(tmp_path):
    location = str(tmp_path / "ledger.sqlite")
    with Ledger.open(location) as ledger:
        ledger.append(
            [
                Record(
                    **GPU3,
                    command="minimize",
                    verdict="reproduced",
                    evidence="minimize: x",
                    job="4711",
                    operator="aten.mm.default",
                    element="5",
                    bits="22",
                    rate=1.0,
                    rank=2,
                    iteration=7,
                ),
                Record("GPU-aaaa", "cuda:0", "h17.cluster", "replay", "match", "replay: match"),
                Record(
                    "cpu:1@h18",
                    "cpu:1",
                    "h18",
                    "screen",
                    "failed",
                    "screen: y",
                    operator="aten.addmm.default",
                    bits="3,30",
                ),
            ]
        )
    return {"SDCREPLAY_LEDGER": location}


def test_slurm_drains_each_node_with_a_suspect_device(env, cli):
    done = cli("devices", "export", "--format", "slurm", env=env)
    assert done.exit_code == 0, done.stderr
    assert done.stdout.splitlines() == [
        'scontrol update NodeName=h17 State=DRAIN Reason="sdcreplay: '
        'cuda:3 GPU-3f2a suspect: minimize aten.mm element 5 bit 22 rate 1"',
        'scontrol update NodeName=h18 State=DRAIN Reason="sdcreplay: '
        'cpu:1 cpu:1@h18 suspect: screen aten.addmm bit 3,30"',
    ]


def test_kubernetes_taints_and_annotates_each_suspect_device(env, cli):
    lines = cli("devices", "export", "--format", "kubernetes", env=env).stdout.splitlines()
    assert lines[:2] == [
        "kubectl taint nodes h17.cluster sdcreplay.io/sdc-cuda-3=suspect:NoSchedule --overwrite",
        'kubectl annotate node h17.cluster sdcreplay.io/sdc-cuda-3="sdcreplay: cuda:3 GPU-3f2a '
        'suspect: minimize aten.mm element 5 bit 22 rate 1" --overwrite',
    ]
    assert lines[2].startswith("kubectl taint nodes h18 sdcreplay.io/sdc-cpu-1=suspect:")


def test_json_names_every_node_and_its_lines(env, cli):
    data = json.loads(cli("devices", "export", "--format", "json", env=env).stdout)
    assert data["schema"] == "sdcreplay.export/1"
    assert [node["host"] for node in data["nodes"]] == ["h17.cluster", "h18"]
    assert [d["id"] for d in data["nodes"][0]["devices"]] == ["GPU-3f2a"]  # cuda:0 is healthy
    assert data["nodes"][0]["slurm"].startswith("scontrol update NodeName=h17 State=DRAIN")


def test_tracker_lines_read_as_megatrons(env, cli):
    lines = cli("devices", "export", "--format", "tracker", env=env).stdout.splitlines()
    assert len(lines) == 3  # every device's records
    megatron = re.compile(  # RerunStateMachine.get_skipped_iterations_from_tracker_file's
        r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) "
        r"result=.+ message=.+"
    )
    job, rank, iteration, status = megatron.search(lines[0]).groups()
    assert (job, int(rank), int(iteration), status) == ("4711", 2, 7, "reproduced")
    assert "node=h17.cluster device=cuda:3 " in lines[0]
    assert "result=aten.mm.default:element=5:bits=22:rate=1 " in lines[0]
    assert lines[0].endswith("message='sdcreplay minimize: GPU-3f2a: minimize: x'")


def test_nothing_to_drain_prints_nothing_on_stdout(tmp_path, cli):
    location = str(tmp_path / "ledger.sqlite")
    with Ledger.open(location) as ledger:
        ledger.append([Record("GPU-aaaa", "cuda:0", "h17", "replay", "match", "replay: match")])
    done = cli("devices", "export", env={"SDCREPLAY_LEDGER": location})
    assert done.exit_code == 0 and done.stdout == ""
    assert "nothing to drain" in done.stderr
