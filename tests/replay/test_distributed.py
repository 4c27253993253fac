"""Multi-rank jobs on real torch.distributed (gloo, processes on this machine, each job with a
timeout): record with --nproc, replay every rank bit for bit (messages included), name the
rank where a planted fault began, bisect inside that rank, refuse another collective order,
report a rank that dies.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SMALL, SMALL_ARGS, TESTS, preserved_global_state

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.capture.faults import Injector, parse_specs
from sdcreplay.capture.message import Message
from sdcreplay.compare.jobs import diff_jobs
from sdcreplay.compare.origin import NO_ORIGIN, Origin, find_origin
from sdcreplay.errors import DeviceError
from sdcreplay.recording.job import record_job
from sdcreplay.replay.job import replica_devices

MISBEHAVING = TESTS / "misbehaving.py"
# The backward matmul that computes the head's weight gradient on rank 2, one bit of one element.
FAULT = "kind=bitflip,op=aten.mm,phase=backward,step=0,nth=0,index=3,bit=22"
TIMEOUT = ["--timeout", "60"]  # a job that makes no progress for a minute is ended and reported


def run_json(cli, *args: str, code: int) -> dict:
    result = cli(*args, "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def job4(builtin_job) -> Path:
    """A 2-step recording of 4 DDP ranks of the small tiny-llama (the run's shared one,
    tests/replay/test_same_batch.py's too)."""
    return builtin_job("ddp", 4).out


@pytest.fixture(scope="module")
def misbehaving_job(tmp_path_factory) -> Path:
    """2 ranks of a workload with two explicit all-reduces per step; replayed on cpu:1 it swaps
    them from its second step on, on cpu:3 it kills itself there, on cpu:5 it hangs there
    (recorded on cpu: none of these)."""
    out = tmp_path_factory.mktemp("misjob") / "mis.bundle"
    kwargs = {
        **SMALL,
        "collective": True,
        "misbehave": "cpu:1=swap,cpu:3=kill,cpu:5=hang",
        "at_step": 1,
    }
    with preserved_global_state():
        record_job(f"{MISBEHAVING}:make_workload", out, nproc=2, steps=2, kwargs=kwargs, timeout=60)
    return out


def test_two_ranks_record_and_replay_bit_for_bit_messages_included(cli, builtin_job, tmp_path):
    """`record --nproc 2` (the run's shared recording: conftest ``builtin_job``), then replay."""
    result = builtin_job("ddp")
    bundle, logs = result.out, tmp_path / "logs"
    recorded = result.json()
    assert re.search(  # the progress line shows the steps, not "on 2 ranks:  (72.3 s)"
        r"recording builtin:tiny-llama on 2 ranks: 2/2, steps on each rank, loss \d+\.\d{4} \(",
        result.stderr,
    ), result.stderr
    assert recorded["world_size"] == 2 and recorded["kwargs"]["parallel"] == "ddp"
    assert [rank["steps"] for rank in recorded["ranks"]] == [2, 2]
    (run,) = bundle.with_name(f"{bundle.name}.logs").iterdir()  # the recording's run directory
    assert (run / "record-rank1.stderr.txt").is_file()

    info = run_json(cli, "info", bundle, code=0)
    job = JobBundle.open(bundle)
    # DDP's messages: its gradient bucket's all-reduce in every step (and the broadcasts its
    # second forward adds), the same calls on both ranks.
    logged = {part.rank: job.rank(part.rank).messages() for part in job.ranks}
    calls = {
        rank: {step: [m.profiling_name for m in found] for step, found in steps.items()}
        for rank, steps in logged.items()
    }
    assert calls[0] == calls[1] and sorted(calls[0]) == [0, 1]
    assert all("gloo:all_reduce" in names for names in calls[0].values())
    assert info["ranks"] == 2
    assert info["messages"] == sum(
        len(found) for steps in logged.values() for found in steps.values()
    )
    assert [part["messages"] for part in info["parts"]] == [info["messages"] // 2] * 2

    replayed = run_json(cli, "replay", bundle, "--logs", logs, *TIMEOUT, code=0)
    assert replayed["world_size"] == 2 and replayed["verdict"] == "correct"
    assert replayed["origin_rank"] is None and replayed["first_divergent_message"] is None
    for rank in replayed["ranks"]:
        assert [device["verdict"] for device in rank["devices"]] == ["match"]
    for rank in (0, 1):  # the replay's own messages: the record's, digests included
        written = json.loads((logs / "replica0" / f"rank{rank}.r0.messages.json").read_text())
        messages = {
            int(s): [Message.from_json(m) for m in ms] for s, ms in written["steps"].items()
        }
        assert messages == logged[rank]
    diffed = run_json(cli, "diff", bundle, logs / "replica0", code=0)
    assert diffed["identical"] and diffed["world_size"] == 2


def test_a_job_a_users_torchrun_script_recorded_replays_through_the_cli(cli, ddp_job, tmp_path):
    """The user's own script (tests/job_script.py, run by torchrun with a Recorder in its loop,
    its workload a function of that file) is replayed by `sdcreplay replay` through the elastic
    launcher: every rank bit for bit, its messages (DDP's bucket, two logging all_reduces, the
    bucket rebuild's broadcasts) equal to the record."""
    job, _ = ddp_job
    replayed = run_json(
        cli, "replay", job, "--trust-workload", "--logs", tmp_path / "logs", *TIMEOUT, code=0
    )
    assert replayed["job"] is True and replayed["world_size"] == 2
    assert replayed["origin_rank"] is None and replayed["first_divergent_message"] is None
    assert replayed["verdict"] == "correct" and replayed["failed"] == []
    assert [rank["consensus"]["verdict"] for rank in replayed["ranks"]] == ["correct"] * 2


def test_a_job_replayed_on_another_kind_of_machine_says_why_there_is_no_verdict(
    cli, ddp_job, tmp_path
):
    """Every rank's replica computes aten.mm with other bits (another CPU model, simulated):
    incomparable, exit 3 with the reason and what to do, doctor pointed at a rank's part."""
    job, _ = ddp_job
    done = cli(
        "replay", job, "--trust-workload", "--logs", tmp_path / "logs", *TIMEOUT,
        env={"SDCREPLAY_OTHER_MACHINE": "aten.mm.default"},
    )  # fmt: skip
    assert done.exit_code == 3, done.output
    error = next(line for line in done.stderr.splitlines() if line.startswith("Error:"))
    assert error.startswith(
        "Error: no verdict: no replica ran on a machine comparable with the recording's "
        "(rank 0 cpu: probe: aten.mm.default ["
    )
    hint = " ".join(done.stderr[done.stderr.index("Hint:") :].split())
    assert f"`sdcreplay doctor --against {job / 'ranks' / '000000'}`" in hint


def test_a_bitflip_on_rank_2_of_4_is_its_origin_and_bisect_names_the_operator(cli, job4, tmp_path):
    # Replica 0 (cpu:0-3) replays clean, replica 1 (cpu:4-7) with the fault on its rank 2.
    devices = [arg for n in range(8) for arg in ("-d", f"cpu:{n}")]
    fault = f"{FAULT},rank=2,device=cpu:6"
    replayed = run_json(
        cli, "replay", job4, *devices, "--inject", fault, "--logs", tmp_path / "logs", *TIMEOUT,
        code=1,
    )  # fmt: skip
    clean, faulty = replayed["replicas"]
    assert clean["origin_rank"] is None and clean["spread_ranks"] == []  # bit for bit
    assert (clean["repeat"], faulty["repeat"]) == (None, 0)
    assert faulty["devices"] == ["cpu:4", "cpu:5", "cpu:6", "cpu:7"]
    assert replayed["origin_rank"] == 2
    assert replayed["spread_ranks"] == [0, 1, 3]
    first = replayed["first_divergent_message"]
    assert {k: first[k] for k in ("rank", "step", "collective_seq_id", "which")} == {
        "rank": 2,
        "step": 0,
        "collective_seq_id": 0,
        "which": "input",
    }
    assert first["profiling_name"] == "gloo:all_reduce" and first["input_differs"] == [2]
    assert replayed["verdict"] == "persistent"
    # Only rank 2's device is accused: the others computed what the all-reduce gave them.
    assert replayed["suspects"] == ["cpu:6"]
    runs = [run for rank in replayed["ranks"] for run in rank["devices"]]
    spread = {run["device"]: run["spread_from"] for run in runs if "spread_from" in run}
    assert spread == {"cpu:4": 2, "cpu:5": 2, "cpu:7": 2}
    assert {run["device"]: run["verdict"] for run in runs if run["device"] >= "cpu:4"} == {
        "cpu:4": "spread",
        "cpu:5": "spread",
        "cpu:6": "persistent",
        "cpu:7": "spread",
    }
    diffed = run_json(cli, "diff", job4, tmp_path / "logs" / "replica1", code=1)
    assert diffed["origin_rank"] == 2 and diffed["first_divergent_message"] == first
    table = cli("diff", job4, tmp_path / "logs" / "replica1").stderr
    assert "origin rank" in table and "rank 2" in table and "spread to ranks" in table
    assert "step 0, gloo:all_reduce (collective_seq_id 0" in table

    report = run_json(
        cli, "bisect", job4, "--rank", "2", "--suspect", "cpu:2", "--reference", "cpu:0",
        "--step", "0", "--inject", f"{FAULT},rank=2,device=cpu:2", "--out", tmp_path / "b",
        code=1,
    )  # fmt: skip
    assert report["rank"] == 2 and report["step"] == 0
    assert (report["phase"], report["module"], report["op"]) == (
        "backward",
        "output",
        "aten.mm.default",
    )
    assert report["isolated"] == "kernel"
    assert report["elements"]["indices"] == [3] and report["bits"]["histogram"] == {"22": 1}


def test_a_job_recorded_with_a_faulty_rank_accuses_that_ranks_recording_only(cli, tmp_path):
    """The usual case: the defect was on a recording GPU. Two clean replicas agree with each
    other against the record on every rank; only rank 1's recording is accused, rank 0's record
    diverged because the all-reduce brought it rank 1's corruption."""
    bundle = tmp_path / "bad.bundle"
    with preserved_global_state():
        record_job(
            "builtin:tiny-llama", bundle, nproc=2, steps=2, kwargs=dict(SMALL),
            inject=[f"{FAULT.replace('step=0', 'step=1')},rank=1"], timeout=60,
        )  # fmt: skip
    devices = [arg for n in range(4) for arg in ("-d", f"cpu:{n}")]
    replayed = run_json(cli, "replay", bundle, *devices, *TIMEOUT, code=1)
    assert replayed["verdict"] == "recording_suspect"
    assert replayed["suspects"] == ["record:rank1 (cpu)"]
    assert replayed["origin_rank"] == 1 and replayed["spread_ranks"] == [0]
    assert [rank["record"] for rank in replayed["ranks"]] == [
        {"verdict": "spread", "spread_from": 1},
        {"verdict": "persistent"},
    ]
    runs = [run for rank in replayed["ranks"] for run in rank["devices"]]
    assert {run["verdict"] for run in runs} == {"match"}
    table = cli("replay", bundle, *devices, *TIMEOUT).stderr
    assert "Verdict: recording_suspect (suspects: record:rank1 (cpu))" in table
    assert "│ 0    │ record │ spread " in table, table


def test_two_collectives_swapped_in_a_replay_are_a_structural_divergence(
    cli, misbehaving_job, tmp_path
):
    result = cli("replay", misbehaving_job, "-d", "cpu:0", "-d", "cpu:1", *TIMEOUT)
    assert result.exit_code == 3, result.output
    assert "Error: rank 1 (cpu:1): step 1, message record_id 0: the record has" in result.stderr
    assert "gloo:all_reduce" in result.stderr and "Hint:" in result.stderr
    assert "Traceback" not in result.output


def test_a_rank_killed_mid_replay_is_reported_and_the_others_end(cli, misbehaving_job, tmp_path):
    logs = tmp_path / "logs"
    result = cli("replay", misbehaving_job, "-d", "cpu:2", "-d", "cpu:3", "--logs", logs, "--json")
    assert result.exit_code == 3, result.output
    replayed = json.loads(result.stdout)
    assert replayed["failed"] == [{"rank": 0, "device": "cpu:2"}, {"rank": 1, "device": "cpu:3"}]
    killed = replayed["ranks"][1]["devices"][0]["error"]
    assert killed["message"] == "rank 1 (cpu:3) killed by signal SIGKILL"
    assert killed["exit_status"] == -9
    assert killed["log"] == str(logs / "replica0" / "replay-rank1.stderr.txt")
    other = replayed["ranks"][0]["devices"][0]["error"]  # ended, not left waiting
    assert other["message"].startswith("rank 0 (cpu:2)")
    # Its collective either fails on the dead peer ("... (after rank 1 failed)") or the
    # supervisor stops it first ("was stopped after rank 1 failed (it was at ...)"): a race.
    assert "after rank 1 failed" in other["message"], other["message"]
    assert (
        "Error: the replay failed: rank 1 (cpu:3) killed by signal SIGKILL [exit status -9] "
        "(then rank [0] ended)" in result.stderr
    ), result.stderr


def test_a_rank_that_hangs_mid_replay_is_killed_and_the_others_end(cli, misbehaving_job):
    result = cli("replay", misbehaving_job, "-d", "cpu:4", "-d", "cpu:5", "--timeout", "5")
    assert result.exit_code == 3, result.output
    assert (
        "Error: the replay failed: rank 1 (cpu:5) made no progress for 5 s (at step 1 (repeat 0)) "
        "while the other ranks waited, and was killed [exit status -9] (then rank [0] ended)"
    ) in result.stderr.replace("\n", " ")


def message(rank: int, op_id: int, input_digest: str, output_digest: str, step: int = 0):
    return Message(
        step, op_id, 0, "0", op_id, None, op_id, "gloo:all_reduce", [[4]], ["float32"],
        [[4]], ["float32"], input_digest, output_digest,
    )  # fmt: skip


def test_origin_is_the_one_rank_whose_input_differs_first():
    recorded = {
        r: {0: [message(r, 0, f"in{r}", "sum"), message(r, 1, f"x{r}", "y")]} for r in (0, 1, 2)
    }
    one = {
        r: {0: [message(r, 0, "bad" if r == 1 else f"in{r}", "wrong"), message(r, 1, "z", "y")]}
        for r in (0, 1, 2)
    }
    origin = find_origin(recorded, one, diverged={0, 1, 2})
    assert origin.origin_rank == 1 and origin.spread_ranks == [0, 2]
    assert origin.first_divergent_message["which"] == "input"
    both = {r: {0: [message(r, 0, "bad", "wrong"), message(r, 1, f"x{r}", "y")]} for r in (0, 1, 2)}
    assert find_origin(recorded, both, diverged=set()).origin_rank is None  # several at once
    delivered = {
        r: {0: [message(r, 0, f"in{r}", "wrong"), message(r, 1, f"x{r}", "y")]} for r in (0, 1, 2)
    }
    only_outputs = find_origin(recorded, delivered, diverged=set())
    assert only_outputs.origin_rank is None
    assert only_outputs.first_divergent_message["which"] == "output"
    local = find_origin(recorded, recorded, diverged={2})  # never reached a message
    assert (local.origin_rank, local.first_divergent_message) == (2, None)
    assert find_origin(recorded, recorded, diverged=set()) == NO_ORIGIN


def test_device_labels_map_to_replicas_in_groups_of_world_size(job4):
    job = JobBundle.open(job4)
    assert replica_devices(job, None) == [["cpu", "cpu", "cpu", "cpu"]]
    labels = [f"cpu:{n}" for n in range(8)]
    assert replica_devices(job, labels) == [labels[:4], labels[4:]]
    with pytest.raises(DeviceError, match="6 device labels for a job of 4 ranks"):
        replica_devices(job, labels[:6])
    with pytest.raises(DeviceError, match="two ranks of one job would share a GPU"):
        replica_devices(job, ["cuda:0", "cuda:1", "cuda:1", "cuda:2"])  # NCCL: one GPU a rank
    with pytest.raises(DeviceError, match="rank 0 would replay on cpu:0 in two replicas"):
        replica_devices(
            job, ["cpu:0", "cpu:1", "cpu:2", "cpu:3", "cpu:0", "cpu:5", "cpu:6", "cpu:7"]
        )


def test_a_fault_spec_with_a_rank_applies_only_on_that_rank():
    specs = parse_specs([f"{FAULT},rank=2"], include_env=False)
    assert Injector(specs, "cpu", rank=2).specs == specs
    assert Injector(specs, "cpu", rank=1).specs == []
    assert Injector(specs, "cpu", rank=None).specs == []  # not in a job at all


@pytest.mark.slow
def test_a_replica_started_by_torchrun_is_compared_by_diff(misbehaving_job, tmp_path):
    """The multi-node command line of docs/distributed.md, on one node: torchrun starts the
    ranks, `python -m sdcreplay.replay.job` replays each one's part, diff compares the logs.
    The fault flips a forward bit on rank 1 only; no message carries it (the workload's
    collectives sum tensors of ones), so the rank whose signatures alone differ is the origin."""
    torchrun = Path(sys.executable).parent / "torchrun"
    logs = tmp_path / "logs"
    fault = "kind=bitflip,op=aten.mm,phase=forward,step=1,nth=0,index=0,bit=22,rank=1"
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", "-m"]
    command += ["sdcreplay.replay.job", str(misbehaving_job), str(logs), "--inject", fault]
    ran = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-3000:]
    comparison = diff_jobs(misbehaving_job, logs)
    assert [c.identical for c in comparison.ranks.values()] == [True, False]
    assert comparison.ranks[1].first.step == 1
    assert comparison.origin == Origin(1, None, [])


@pytest.mark.slow
def test_fsdp2_ranks_record_and_replay_bit_for_bit(cli, builtin_job, tmp_path):
    result = builtin_job("fsdp2")  # the run's shared recording
    bundle, recorded = result.out, result.json()
    assert recorded["kwargs"]["parallel"] == "fsdp2"
    job = JobBundle.open(bundle)
    names = {
        m.profiling_name for steps in [job.rank(0).messages()] for ms in steps.values() for m in ms
    }
    assert names == {"gloo:_allgather_base", "gloo:_reduce_scatter_base"}
    replayed = run_json(cli, "replay", bundle, "--logs", tmp_path / "logs", *TIMEOUT, code=0)
    assert replayed["verdict"] == "correct" and replayed["origin_rank"] is None


def test_a_fault_spec_that_fires_on_no_rank_it_names_is_an_error_not_a_finding(
    cli, misbehaving_job
):
    spec = "kind=bitflip,op=aten.mm,phase=backward,module=layers.9,rank=1"
    result = cli("replay", misbehaving_job, "-d", "cpu:0", "-d", "cpu:2", "--inject", spec)
    assert result.exit_code == 3, result.output
    error = result.stderr.split("Error: fault spec ")[1]
    assert "module=layers.9" in error and "rank=1" in error, result.stderr
    assert "matches no operator call of the replayed steps" in error
    assert "Hint: Closest calls:" in result.stderr and "Traceback" not in result.output
    hint = " ".join(result.stderr.split("Hint:", 1)[1].split())
    assert hint.endswith(f"`sdcreplay ops {misbehaving_job} --rank 1 --step N` lists them all.")


def test_job_commands_refuse_what_cannot_work_before_starting_ranks(cli, job4, small_bundle):
    refusals = [
        (("record", "builtin:tiny-llama", "--nproc", "2", "--out", job4), "already exists"),
        (("bisect", job4), "is a job of 4 ranks: say which rank to bisect"),
        (("bisect", job4, "--rank", "1", "--repeats", "2"), "--repeats is for a single"),
        (("bisect", small_bundle, "--rank", "1"), "--rank 1 is for a job bundle"),
        (("replay", job4, "-d", "cpu:0", "-d", "cpu:1"), "2 device labels for a job of 4"),
        (("replay", job4, "--inject", f"{FAULT},rank=4"), "but the job has ranks 0..3"),
    ]
    for args, needle in refusals:
        result = cli(*args)
        assert result.exit_code == 3, result.output
        assert needle in result.stderr and "Hint:" in result.stderr, result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL: a GPU a rank)"
)
def test_nccl_ranks_record_and_replay_bit_for_bit(cli, tmp_path):
    bundle = tmp_path / "nccl.bundle"
    recorded = run_json(
        cli, "record", "builtin:tiny-llama", "--nproc", "2", "--device", "cuda", "--steps", "2",
        *SMALL_ARGS, "--out", bundle, code=0,
    )  # fmt: skip
    assert [rank["device"] for rank in recorded["ranks"]] == ["cuda:0", "cuda:1"]
    names = {
        m.profiling_name for ms in JobBundle.open(bundle).rank(0).messages().values() for m in ms
    }
    assert "nccl:all_reduce" in names
    replayed = run_json(cli, "replay", bundle, "--logs", tmp_path / "logs", *TIMEOUT, code=0)
    assert replayed["verdict"] == "correct"
