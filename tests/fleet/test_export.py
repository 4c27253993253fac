"""export prints what a person would run to drain suspect devices (and runs nothing): Slurm's
scontrol line per node, Kubernetes taints, JSON, and Megatron's tracker lines. The lines are
data, never code: pasted into bash with hostile names, hosts, reasons and labels in the
ledger, they run only scontrol and kubectl, with exactly the arguments meant."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from sdcreplay.fleet.export import export
from sdcreplay.fleet.states import by_device
from sdcreplay.ledger.schema import Record
from sdcreplay.ledger.store import Ledger
from sdcreplay.ledger.tracker import tracker_line

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
        "scontrol update NodeName=h17 State=DRAIN Reason='sdcreplay: "
        "cuda:3 GPU-3f2a suspect: minimize aten.mm element 5 bit 22 rate 1'",
        "scontrol update NodeName=h18 State=DRAIN Reason='sdcreplay: "
        "cpu:1 cpu:1@h18 suspect: screen aten.addmm bit 3,30'",
    ]


def test_kubernetes_taints_and_annotates_each_suspect_device(env, cli):
    lines = cli("devices", "export", "--format", "kubernetes", env=env).stdout.splitlines()
    assert lines[:2] == [
        "kubectl taint nodes h17.cluster sdcreplay.io/sdc-cuda-3=suspect:NoSchedule --overwrite",
        "kubectl annotate node h17.cluster sdcreplay.io/sdc-cuda-3='sdcreplay: cuda:3 GPU-3f2a "
        "suspect: minimize aten.mm element 5 bit 22 rate 1' --overwrite",
    ]
    assert lines[2].startswith("kubectl taint nodes h18 sdcreplay.io/sdc-cpu-1=suspect:")


def test_json_names_every_node_and_its_lines(env, cli):
    data = json.loads(cli("devices", "export", "--format", "json", env=env).stdout)
    assert data["schema"] == "sdcreplay.export/1"
    assert [node["host"] for node in data["nodes"]] == ["h17.cluster", "h18"]
    assert [d["id"] for d in data["nodes"][0]["devices"]] == ["GPU-3f2a"]  # cuda:0 is healthy
    assert data["nodes"][0]["slurm"].startswith("scontrol update NodeName=h17 State=DRAIN")
    assert [node["drill"] for node in data["nodes"]] == [False, False]


# Megatron's RerunStateMachine.get_skipped_iterations_from_tracker_file reads a line so
MEGATRON = re.compile(r"ts=.+ node=.+ device=.+ jobID=.+ rank=(.+) iteration=(.+) status=(.+) .+")
FIELD_BY_FIELD = re.compile(
    r"ts=(\S+) node=(\S+) device=(\S+) jobID=(\S+) rank=(-?\d+) iteration=(-?\d+) "
    r"status=(\S+) result=(\S+) message='([^'\n]*)'"
)


def test_tracker_lines_read_as_megatrons(env, cli):
    lines = cli("devices", "export", "--format", "tracker", env=env).stdout.splitlines()
    assert len(lines) == 3  # every device's records
    ts, node, device, job, rank, iteration, status, result, message = FIELD_BY_FIELD.fullmatch(
        lines[0]
    ).groups()
    assert (node, device, job, int(rank), int(iteration), status) == (
        "h17.cluster",
        "cuda:3",
        "4711",
        2,
        7,
        "reproduced",
    )
    assert result == "aten.mm.default:element=5:bits=22:rate=1"
    assert message == "sdcreplay minimize: GPU-3f2a: minimize: x"
    assert [int(g) for g in MEGATRON.search(lines[0]).groups()[:2]] == [2, 7]


def test_nothing_to_drain_prints_nothing_on_stdout(tmp_path, cli):
    location = str(tmp_path / "ledger.sqlite")
    with Ledger.open(location) as ledger:
        ledger.append([Record("GPU-aaaa", "cuda:0", "h17", "replay", "match", "replay: match")])
    done = cli("devices", "export", env={"SDCREPLAY_LEDGER": location})
    assert done.exit_code == 0 and done.stdout == ""
    assert "nothing to drain" in done.stderr


# Text that reaches the lines from other people's files and machines.
HOSTILE = [
    "$(touch PWNED)",
    "`touch PWNED`",
    ";touch PWNED",
    "'; touch PWNED; echo '",
    '"; touch PWNED; echo "',
    "a\ntouch PWNED\n",
    "a\rtouch PWNED",
    "\x1b[31mred\x1b[0m \u202etxet\u2028next",
    "ünïcødé ✓ 断",
    "$HOME ${PATH} \\ * ? ~ & | < > ! # %",
]


def _hostile_ledger(location: str) -> None:
    records = []
    for n, text in enumerate(HOSTILE):
        common = dict(command="minimize", verdict="reproduced", evidence=text, operator=text)
        records.append(Record(f"GPU-{n}", f"cuda:{n}", f"node{n}", job=text, **common))  # good host
        records.append(Record(f"GPU-h{n}", text, text, **common))  # the host itself hostile
        records.append(Record(f"GPU-l{n}", text + ":9", f"lab{n}.example", **common))
    records.append(Record("GPU-c", "cuda:7", "node0", "clear", "cleared", "cleared: " + HOSTILE[5]))
    with Ledger.open(location) as ledger:
        ledger.append(records)


def _stub(bin_dir, name: str, argv_file) -> None:
    script = bin_dir / name
    script.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"with open({str(argv_file)!r}, 'a') as f: f.write(json.dumps(sys.argv) + '\\n')\n"
    )
    script.chmod(0o755)


def _paste(lines: list[str], tmp_path) -> list[list[str]]:
    """Run ``lines`` in a real bash, in an empty directory, with scontrol/kubectl stubs that
    write their argv; returns every call's argv (the command's name first)."""
    script = "".join(line + "\n" for line in lines)
    checked = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    bin_dir, work = tmp_path / "bin", tmp_path / "work"
    bin_dir.mkdir(exist_ok=True)
    work.mkdir(exist_ok=True)
    argv_file = tmp_path / "argv.jsonl"
    argv_file.unlink(missing_ok=True)
    for name in ("scontrol", "kubectl"):
        _stub(bin_dir, name, argv_file)
    environment = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    ran = subprocess.run(
        ["bash", "-e", "-u"],
        input=script,
        cwd=work,
        env=environment,
        capture_output=True,
        text=True,
    )
    assert ran.returncode == 0, ran.stderr
    assert not list(work.iterdir()) and not list(tmp_path.glob("**/PWNED"))  # nothing else ran
    calls = (
        [json.loads(line) for line in argv_file.read_text().splitlines()]
        if argv_file.exists()
        else []
    )
    return [[os.path.basename(call[0]), *call[1:]] for call in calls]


def test_pasted_exports_run_only_the_drains_with_exactly_their_arguments(tmp_path):
    location = str(tmp_path / "ledger.sqlite")
    _hostile_ledger(location)
    devices = {d.id: d for d in by_device(Ledger.open(location).records())}

    slurm = export("slurm", location)
    calls = _paste(slurm.lines, tmp_path)
    good = [node for n in range(len(HOSTILE)) for node in (f"node{n}", f"lab{n}")]
    assert [call[2] for call in calls] == [f"NodeName={node}" for node in good]
    for call in calls:
        assert call[:2] == ["scontrol", "update"] and call[3] == "State=DRAIN" and len(call) == 5
        reason = call[4].removeprefix("Reason=sdcreplay: ")
        assert "\n" not in reason and "\r" not in reason and "\x1b" not in reason
    assert calls[0][4] == "Reason=sdcreplay: cuda:0 GPU-0 suspect: minimize $(touch PWNED)"
    refused = [line for line in slurm.lines if line.startswith("#")]
    assert len(refused) == len(HOSTILE) and all("not a valid slurm node name" in r for r in refused)
    assert sorted(slurm.refused()) == sorted(set(HOSTILE))

    kubernetes = export("kubernetes", location)
    calls = _paste(kubernetes.lines, tmp_path)
    taints = [call for call in calls if call[1] == "taint"]
    annotations = [call for call in calls if call[1] == "annotate"]
    assert len(taints) == len(annotations) == 2 * len(HOSTILE)
    for taint in taints:
        assert taint[:3] == ["kubectl", "taint", "nodes"] and taint[5] == "--overwrite"
        key = taint[4].partition("=")[0]
        assert re.fullmatch(r"sdcreplay\.io/[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", key)
        assert taint[4].endswith("=suspect:NoSchedule")
    device = devices["GPU-l3"]  # the label "'; touch PWNED; echo ':9" on lab3.example
    assert ["kubectl", "annotate", "node", "lab3.example"] in [call[:4] for call in annotations]
    hostile_annotation = next(call for call in annotations if call[3] == "lab3.example")
    assert hostile_annotation == [
        "kubectl",
        "annotate",
        "node",
        "lab3.example",
        "sdcreplay.io/sdc----touch-PWNED--echo---9=sdcreplay: "
        + f"{device.label} GPU-l3 suspect: minimize '; touch PWNED; echo '",
        "--overwrite",
    ]
    assert len([line for line in kubernetes.lines if line.startswith("#")]) == len(HOSTILE)

    tracker = export("tracker", location).lines
    assert len(tracker) == 3 * len(HOSTILE) + 1
    for line in tracker:
        fields = FIELD_BY_FIELD.fullmatch(line)
        assert fields is not None, line
        assert [int(g) for g in MEGATRON.search(line).groups()[:2]] == [
            int(fields[5]),
            int(fields[6]),
        ]


def test_a_refused_node_is_said_on_stderr(tmp_path, cli):
    location = str(tmp_path / "ledger.sqlite")
    with Ledger.open(location) as ledger:
        ledger.append([Record("GPU-1", "cuda:1", "h[1-9]", "replay", "persistent", "replay: x")])
    done = cli("devices", "export", "--ledger", location)
    assert done.exit_code == 0, done.stderr
    assert done.stdout.startswith("# sdcreplay: not exported: the host 'h[1-9]' (cuda:1 GPU-1)")
    assert "Warning: 1 node(s) not exported: their host names are not valid slurm" in done.stderr


def test_tracker_lines_of_every_record_kind_read_as_megatrons():
    kinds = [
        Record(**GPU3, command="replay", verdict="match", evidence="replay: match, 0 of 1"),
        Record(**GPU3, command="replay", verdict="persistent", evidence="e", rank=3, iteration=2),
        Record(**GPU3, command="replay", verdict="recording_suspect", evidence="e"),
        Record(**GPU3, command="bisect", verdict="divergence", evidence="e", operator="aten.mm"),
        Record(**GPU3, command="minimize", verdict="not reproduced", evidence="e", rate=0.0),
        Record(**GPU3, command="screen", verdict="passed", evidence="screen: passed 3 tickets"),
        Record(**GPU3, command="alarm", verdict="alarm (transient)", evidence="e", iteration=4),
        Record(**GPU3, command="dump", verdict="dumped", evidence="dump: update", iteration=9),
        Record(
            **GPU3,
            command="clear",
            verdict="cleared",
            evidence="cleared: RMA 'returned'\nrank=9 iteration=9 status=x y",
        ),
    ]
    for record in kinds:
        line = tracker_line(record)
        fields = FIELD_BY_FIELD.fullmatch(line)
        assert fields is not None, line
        rank, iteration, status = MEGATRON.search(line).groups()
        assert (int(rank), int(iteration)) == (record.rank or 0, record.iteration or -1)
        assert status.startswith(fields[7] + " result=")  # Megatron's greedy group
    cleared = FIELD_BY_FIELD.fullmatch(tracker_line(kinds[-1]))
    assert cleared.groups()[6:] == (
        "cleared",
        "cleared",
        'sdcreplay clear: GPU-3f2a: cleared: RMA "returned" rank:9 iteration:9 status:x y',
    )
