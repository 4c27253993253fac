"""bisect --rank on a job's rank, as docs/distributed.md gives it: exact every time.

Step 1 of a DDP job is DDP's second iteration, where it rebuilds its buckets with a broadcast
that often completes before the message log attaches its digest; that digest then ran on the
step's own thread under the operator capture, and the step's calls numbered otherwise on one
device than on the other (a structural difference in 4 of 6 runs on a busy machine). The
bisect names the operator, element and bit: the suite reads the run's shared bisect of the
run's shared DDP job (tests/conftest.py: ``rank_bisect``, ``builtin_job``; also read by
tests/minimize/test_minimize_report.py); ``SDCREPLAY_TEST_SHARDED_RUNS=3`` runs it three times
in a row, as every bisect of this module.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import RANK_FAULT

SHARDED_RUNS = int(os.environ.get("SDCREPLAY_TEST_SHARDED_RUNS", "1"))


def test_bisect_on_rank_1_at_the_bucket_rebuild_names_the_flipped_bit_every_time(
    cli, rank_bisect, tmp_path, builtin_job
):
    job = builtin_job("ddp").out
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, RANK_FAULT)
    for run, report in enumerate(reports):
        site = (report["rank"], report["step"], report["phase"], report["module"], report["op"])
        assert site == (1, 1, "backward", "output", "aten.mm.default"), run
        assert report["isolated"] == "kernel"
        assert report["elements"]["indices"] == [3]
        assert report["bits"]["histogram"] == {"20": 1}


# --- sharded jobs: a user's script under torchrun (tests/sharded_script.py) -----------------
#
# Each layout is recorded once; one replay of two replicas (the first clean, the second with a
# fault on one rank) shows the clean replay `correct` and the origin rank, and bisect --rank
# names the planted call exactly for a forward, a backward and an optimizer-step fault.
# SDCREPLAY_TEST_SHARDED_RUNS=10 runs each bisect that many times in a row (the suite: once).

TIMEOUT = ["--timeout", "120"]


def replay_with_fault_on_second_replica(cli, job: Path, world: int, fault: str) -> dict:
    devices = [arg for n in range(2 * world) for arg in ("-d", f"cpu:{n}")]
    result = cli("replay", job, "--trust-workload", *devices, "--inject", fault, *TIMEOUT, "--json")
    assert result.exit_code == 1, result.output
    return json.loads(result.stdout)


def assert_clean_first_replica_and_origin(replayed: dict, world: int, origin: int) -> None:
    first, second = replayed["replicas"]
    assert (first["origin_rank"], first["first_divergent_message"]) == (None, None)
    for rank in replayed["ranks"]:  # every rank of the clean replica matches the record
        assert rank["devices"][0]["verdict"] == "match", rank
    assert second["origin_rank"] == origin
    assert replayed["suspects"] == [f"cpu:{world + origin}"]
    assert replayed["failed"] == []


def bisect_rank(cli, rank_bisect, tmp_path, job: Path, rank: int, fault: str) -> list[dict]:
    """bisect --rank ``rank`` of step 1 on cpu:1 against cpu:0: the run's shared report
    (conftest ``rank_bisect``), and ``SHARDED_RUNS - 1`` more runs in a row: each report."""
    reports = [rank_bisect(job, fault, rank=rank)]
    for run in range(1, SHARDED_RUNS):
        result = cli(
            "bisect", job, "--trust-workload", "--rank", str(rank), "--suspect", "cpu:1",
            "--reference", "cpu:0", "--step", "1", "--inject", fault, "--no-ledger",
            "--out", tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}", "--json",
        )  # fmt: skip
        assert result.exit_code == 1, (run, result.stderr)
        reports.append(json.loads(result.stdout))
    return reports


def assert_names(reports: list[dict], rank: int, phase: str, module: str, op: str) -> None:
    for report in reports:
        site = (report["rank"], report["step"], report["phase"], report["module"], report["op"])
        assert site == (rank, 1, phase, module, op)
        assert report["isolated"] == "kernel"
        assert report["elements"]["indices"] == [3] and report["elements"]["count"] == 1
        assert report["bits"]["histogram"] == {"20": 1}


def fault(where: str, rank: int, device: str = "cpu:1") -> str:
    return f"kind=bitflip,{where},step=1,index=3,bit=20,rank={rank},device={device}"


FORWARD = "op=aten.addmm,module=blocks.1.fc1,phase=forward"
BACKWARD = "op=aten.mm,module=blocks.1.fc2,phase=backward"
OPTIMIZER = "op=aten.addcdiv_,phase=optimizer,nth=2"  # AdamW's update of blocks.0.fc2.weight
# FORWARD on rank 1 of the FSDP2 job as `ops` prints it (with the bit and the device): one run
# for this module and tests/bisect/test_ops_job.py, which bisects that very spec
FSDP2_FORWARD = (
    "kind=bitflip,op=aten.addmm.default,module=blocks.1.fc1,phase=forward,step=1,nth=0,rank=1,"
    "index=3,bit=20,device=cpu:1"
)


def test_fsdp2_replays_names_the_origin_rank_and_bisects_each_phase_exactly(
    cli, rank_bisect, tmp_path, sharded_job
):
    job = sharded_job("fsdp2", 2)
    replayed = replay_with_fault_on_second_replica(cli, job, 2, fault(BACKWARD, 1, "cpu:3"))
    assert_clean_first_replica_and_origin(replayed, 2, origin=1)
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, FSDP2_FORWARD)
    assert_names(reports, 1, "forward", "blocks.1.fc1", "aten.addmm.default")
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, fault(BACKWARD, 1))
    assert_names(reports, 1, "backward", "blocks.1.fc2", "aten.mm.default")
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, fault(OPTIMIZER, 1))
    assert_names(reports, 1, "optimizer", "blocks.0.fc2.weight", "aten.addcdiv_.default")
    for report in reports:  # the parameter's shard on rank 1: rows 4..7 of its 8
        assert report["elements"]["shape"] == [4, 16]


def test_tp_replays_names_the_origin_rank_and_bisects_each_phase_exactly(
    cli, rank_bisect, tmp_path, sharded_job
):
    """Tensor parallelism on a 1-D mesh: an operator's output is a DTensor (or its local
    shard), and its functional all_reduce is a message, never an operator of the step."""
    job = sharded_job("tp", 2)
    replayed = replay_with_fault_on_second_replica(cli, job, 2, fault(FORWARD, 1, "cpu:3"))
    assert_clean_first_replica_and_origin(replayed, 2, origin=1)
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, fault(BACKWARD, 1))
    assert_names(reports, 1, "backward", "blocks.1.fc2", "aten.mm.default")
    if SHARDED_RUNS > 1:  # the full set, one environment variable away
        reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, fault(FORWARD, 1))
        assert_names(reports, 1, "forward", "blocks.1.fc1", "aten.addmm.default")
        reports = bisect_rank(cli, rank_bisect, tmp_path, job, 1, fault(OPTIMIZER, 1))
        assert_names(reports, 1, "optimizer", "blocks.0.fc2.weight", "aten.addcdiv_.default")


def test_fsdp2_x_tp_on_a_2d_mesh_names_the_origin_rank_and_bisects_it(
    cli, rank_bisect, tmp_path, sharded_job
):
    """``init_device_mesh("cpu", (2, 2))``: TP inside pairs of ranks, FSDP2 across them. The
    fault on rank 3 (dp 1, tp 1) reaches its pair's all_reduce first: rank 3 is the origin."""
    job = sharded_job("fsdp2+tp", 4)
    replayed = replay_with_fault_on_second_replica(cli, job, 4, fault(FORWARD, 3, "cpu:7"))
    assert_clean_first_replica_and_origin(replayed, 4, origin=3)
    first = replayed["replicas"][1]["first_divergent_message"]
    assert (first["rank"], first["profiling_name"], first["which"]) == (
        3,
        "gloo:all_reduce",
        "input",
    )
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, 3, fault(BACKWARD, 3))
    assert_names(reports, 3, "backward", "blocks.1.fc2", "aten.mm.default")
    if SHARDED_RUNS > 1:
        reports = bisect_rank(cli, rank_bisect, tmp_path, job, 3, fault(OPTIMIZER, 3))
        assert_names(reports, 3, "optimizer", "blocks.0.fc2.weight", "aten.addcdiv_.default")


BUILTINS = [("fsdp2", 2)] + ([("tp", 2), ("fsdp2+tp", 4)] if SHARDED_RUNS > 1 else [])


@pytest.mark.parametrize(("parallel", "nproc"), BUILTINS)
def test_bisect_on_a_rank_of_a_sharded_builtin(
    cli, rank_bisect, tmp_path, builtin_job, parallel, nproc
):
    """``record builtin:tiny-llama --nproc N -a parallel=...`` (the run's shared recording,
    conftest ``builtin_job``) then bisect --rank, as docs/distributed.md gives it (tp and
    fsdp2+tp under SDCREPLAY_TEST_SHARDED_RUNS)."""
    job = builtin_job(parallel, nproc).out
    spec = fault("op=aten.mm,module=layers.0.mlp.w2,phase=backward,nth=0", nproc - 1)
    reports = bisect_rank(cli, rank_bisect, tmp_path, job, nproc - 1, spec)
    assert_names(reports, nproc - 1, "backward", "layers.0.mlp.w2", "aten.mm.default")
