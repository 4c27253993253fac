"""Pipeline parallelism (``torch.distributed.pipelining``) recorded, replayed and bisected.

A user's script (tests/pipeline_script.py under torchrun) runs a two-stage pipeline of a
four-block MLP, 2 microbatches, with ScheduleGPipe or Schedule1F1B; with 4 ranks, two such
pipelines side by side (pp=2 x dp=2) average each stage's gradients with an all_reduce. The
stages' point-to-point messages are logged in issue order (GPipe: every forward, then every
backward; 1F1B: interleaved), the clean replica replays `correct`, a fault planted on either
stage names that stage's rank the origin and only its device a suspect, and bisect --rank
names the planted call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import TESTS, run_torchrun

from sdcreplay.bundle.job_bundle import JobBundle

TIMEOUT = ["--timeout", "120"]


@pytest.fixture(scope="module")
def pipeline_job(tmp_path_factory):
    """``pipeline_job(schedule, nproc)``: the job bundle tests/pipeline_script.py records."""
    recorded: dict[tuple[str, int], Path] = {}

    def record(schedule: str, nproc: int) -> Path:
        if (schedule, nproc) not in recorded:
            root = tmp_path_factory.mktemp(f"{schedule}-{nproc}")
            script = root / "train.py"
            shutil.copy(TESTS / "pipeline_script.py", script)
            done = run_torchrun(script, nproc, str(root / "job.bundle"), schedule, timeout=300)
            assert done.returncode == 0, done.stderr[-3000:]
            recorded[(schedule, nproc)] = root / "job.bundle"
        return recorded[(schedule, nproc)]

    return record


def p2p_order(job: Path, rank: int, step: int) -> list[tuple[str, int, int]]:
    messages = JobBundle.open(job).rank(rank).messages()[step]
    return [(m.profiling_name, m.peer, m.p2p_seq_id) for m in messages if m.peer is not None]


def replay_json(cli, job: Path, world: int, fault: str) -> dict:
    """Two replicas of the job, the fault on the second one's device of its rank."""
    devices = [arg for n in range(2 * world) for arg in ("-d", f"cpu:{n}")]
    result = cli("replay", job, "--trust-workload", *devices, "--inject", fault, *TIMEOUT, "--json")
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


def assert_origin(replayed: dict, world: int, origin: int, first: tuple) -> None:
    clean, faulty = replayed["replicas"]
    assert (clean["origin_rank"], clean["first_divergent_message"]) == (None, None)
    assert all(rank["devices"][0]["verdict"] == "match" for rank in replayed["ranks"])
    assert faulty["origin_rank"] == origin and replayed["suspects"] == [f"cpu:{world + origin}"]
    message = faulty["first_divergent_message"]
    assert (message["rank"], message["step"], message["profiling_name"], message["which"]) == first


def bisect_json(cli, tmp_path, job: Path, rank: int, fault: str) -> dict:
    result = cli(
        "bisect", job, "--trust-workload", "--rank", str(rank), "--suspect", "cpu:1",
        "--reference", "cpu:0", "--step", "1", "--inject", fault, "--out", tmp_path / "report",
        "--json",
    )  # fmt: skip
    assert result.exit_code == 1, result.stderr
    return json.loads(result.stdout)


def assert_bisected(report: dict, rank: int, phase: str, module: str, op: str) -> None:
    site = (report["rank"], report["step"], report["phase"], report["module"], report["op"])
    assert site == (rank, 1, phase, module, op) and report["isolated"] == "kernel"
    assert report["elements"]["indices"] == [3] and report["bits"]["histogram"] == {"20": 1}


def fault(where: str, rank: int, device: str) -> str:
    return f"kind=bitflip,{where},step=1,index=3,bit=20,rank={rank},device={device}"


STAGE_1_BACKWARD = "op=aten.mm,module=blocks.3.fc2,phase=backward"
STAGE_0_FORWARD = "op=aten.addmm,module=blocks.1.fc1,phase=forward"


def test_gpipe_logs_its_messages_in_order_and_a_stage_1_fault_is_named_and_bisected(
    cli, tmp_path, pipeline_job
):
    job = pipeline_job("gpipe", 2)
    # every microbatch forward, then every backward (step 1: no shape checks any more)
    assert p2p_order(job, 0, 1) == [
        ("gloo:send", 1, 0), ("gloo:send", 1, 1), ("gloo:recv", 1, 2), ("gloo:recv", 1, 3),
    ]  # fmt: skip
    assert p2p_order(job, 1, 1) == [
        ("gloo:recv", 0, 0), ("gloo:recv", 0, 1), ("gloo:send", 0, 2), ("gloo:send", 0, 3),
    ]  # fmt: skip
    replayed = replay_json(cli, job, 2, fault(STAGE_1_BACKWARD, 1, "cpu:3"))
    assert_origin(replayed, 2, 1, (1, 1, "gloo:send", "input"))  # stage 1's gradient to stage 0
    report = bisect_json(cli, tmp_path, job, 1, fault(STAGE_1_BACKWARD, 1, "cpu:1"))
    assert_bisected(report, 1, "backward", "blocks.3.fc2", "aten.mm.default")


def test_1f1b_interleaves_its_messages_and_a_stage_0_fault_is_named_and_bisected(
    cli, tmp_path, pipeline_job
):
    job = pipeline_job("1f1b", 2)
    assert p2p_order(job, 1, 1) == [  # one forward, one backward, ...
        ("gloo:recv", 0, 0), ("gloo:send", 0, 1), ("gloo:recv", 0, 2), ("gloo:send", 0, 3),
    ]  # fmt: skip
    replayed = replay_json(cli, job, 2, fault(STAGE_0_FORWARD, 0, "cpu:2"))
    assert_origin(replayed, 2, 0, (0, 1, "gloo:send", "input"))  # stage 0's activations
    report = bisect_json(cli, tmp_path, job, 0, fault(STAGE_0_FORWARD, 0, "cpu:1"))
    assert_bisected(report, 0, "forward", "blocks.1.fc1", "aten.addmm.default")


def test_pp2_x_dp2_replays_and_names_the_origin_rank(cli, pipeline_job):
    """Ranks (0, 1) and (2, 3) are two pipelines; stage 0 of the second (rank 2) computes
    wrong: its activations reach rank 3 before any gradient all_reduce."""
    job = pipeline_job("gpipe", 4)
    replayed = replay_json(cli, job, 4, fault(STAGE_0_FORWARD, 2, "cpu:6"))
    assert_origin(replayed, 4, 2, (2, 1, "gloo:send", "input"))
