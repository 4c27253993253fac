"""Multi-rank recording on real torch.distributed (gloo, ranks started as torchrun starts them).

A user's script (tests/job_script.py, copied into tmp_path) records data-parallel tiny-llama
with a Recorder in every rank, then replays its part in the same ranks: the job bundle, its
message logs, the bit-for-bit replay with the same messages, and a replay whose collectives
come in another order.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS

from sdcreplay.bundle.job_bundle import JobBundle, is_job_bundle
from sdcreplay.capture import comparable, determinism
from sdcreplay.capture.collectives import LAYOUTS, MessageLog, _below_autograd
from sdcreplay.capture.digest import CPU_ALGORITHM
from sdcreplay.capture.operators import OperatorLog, OperatorMode
from sdcreplay.errors import SdcReplayError
from sdcreplay.replay.session import ReplaySession
from tests.conftest import SMALL, run_torchrun

STEP0 = ["gloo:all_reduce"] * 3  # DDP's one gradient bucket, then the loop's loss and tokens
# DDP rebuilds its buckets at the second iteration: rank 0 broadcasts the new order first.
STEP1 = ["gloo:broadcast", "gloo:broadcast"] + STEP0


def small_llama_parameters() -> int:
    from sdcreplay.workload.tiny_llama import make_workload

    return sum(p.numel() for p in make_workload(**SMALL).model.parameters())


def results(directory: Path) -> list[dict]:
    return [json.loads((directory / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def test_a_ddp_job_bundle_logs_every_bucket_and_collective_of_every_rank(ddp_job):
    job_path, _ = ddp_job
    assert is_job_bundle(job_path)
    job = JobBundle.open(job_path)
    assert (job.world_size, job.backend, job.complete) == (2, "gloo", True)
    assert [(g.pg_id, g.name, g.ranks) for g in job.process_groups] == [(0, "0", [0, 1])]
    assert [(r.rank, r.device, r.part) for r in job.ranks] == [
        (0, "cpu", job_path / "ranks/000000"),
        (1, "cpu", job_path / "ranks/000001"),
    ]
    logs = [job.rank(rank).messages() for rank in (0, 1)]
    bucket = [[small_llama_parameters()]]
    for rank, log in enumerate(logs):
        part = job.rank(rank)
        assert part.verified  # the first step re-executed by both ranks together
        assert (part.manifest.distributed.rank, part.manifest.distributed.world_size) == (rank, 2)
        assert [m.profiling_name for m in log[0]] == STEP0
        assert [m.profiling_name for m in log[1]] == STEP1
        assert [m.input_sizes for m in log[0]] == [bucket, [[1]], [[1]]]
        assert [m.input_dtypes for m in log[0]] == [["float32"], ["float32"], ["int64"]]
        assert [(m.record_id, m.collective_seq_id, m.op_id) for m in log[1]] == [
            (i, i, i) for i in range(5)
        ]
        assert all(m.pg_id == 0 and m.p2p_seq_id is None for m in log[0] + log[1])
    for step, position in ((0, 0), (1, 2)):  # the gradient bucket of each step
        sent = [log[step][position] for log in logs]
        assert sent[0].input_digest != sent[1].input_digest  # each rank its own data shard
        assert sent[0].output_digest == sent[1].output_digest  # the same sum on every rank
    tokens = logs[0][0][2]  # every rank's batch has 2 x 9 tokens: the sum is 36
    assert (tokens.input_digest, tokens.output_digest) == (
        "=int64:0000000000000012",
        "=int64:0000000000000024",
    )


def test_info_json_on_a_job_bundle_gives_its_ranks_and_messages(ddp_job, cli):
    job_path, _ = ddp_job
    result = cli("info", job_path, "--json")
    assert result.exit_code == 0, result.stderr
    about = json.loads(result.stdout)
    assert (about["schema"], about["bundle_schema"]) == ("sdcreplay.info/1", "sdcreplay.job/1")
    assert (about["ranks"], about["messages"], about["complete"]) == (2, 16, True)
    assert about["parts"] == [
        {"rank": rank, "device": "cpu", "steps": 2, "messages": 8, "complete": True}
        for rank in (0, 1)
    ]


def test_each_rank_replays_its_part_bit_for_bit_with_the_recorded_messages(ddp_job):
    job_path, directory = ddp_job
    job = JobBundle.open(job_path)
    for rank, report in enumerate(results(directory)):
        recorded = job.rank(rank).messages()
        assert report["job"] == str(job_path)
        for step in ("0", "1"):
            assert report["replayed"][step]["signatures_equal"] is True
            assert report["replayed"][step]["messages"] == [
                m.to_json() for m in recorded[int(step)]
            ]
        # Bisect's operator mode passes collectives through: it names aten operators and
        # DDP's profiler range, never a c10d call.
        assert report["operator_namespaces"] == ["aten", "profiler"]


def test_collectives_in_another_order_or_number_are_a_message_order_error(ddp_job):
    _, directory = ddp_job
    program = "(another collective order: a different program, not a device's arithmetic)"
    for report in results(directory):
        assert report["order_errors"] == {
            "swapped": "step 0, message record_id 1: the record has gloo:all_reduce on process "
            "group 0 of float32[1], the replay issues gloo:all_reduce on process group 0 of "
            f"int64[1] {program}",
            "missing": "step 0, message record_id 2: the record has gloo:all_reduce on process "
            f"group 0 of int64[1], the replay's step ended without it {program}",
            "extra": "step 0, message record_id 3: the record's step has 3 messages, the "
            "replay issues gloo:all_reduce on process group 0 of float32[2] as one more "
            f"{program}",
        }


def test_a_job_bundle_is_not_overwritten_and_every_rank_says_why(ddp_job):
    job_path, directory = ddp_job
    refused = [report["existing_refused"] for report in results(directory)]
    assert refused == [
        f"{job_path} already exists",
        f"rank 0 could not create the job bundle {job_path}: {job_path} already exists",
    ]


def test_a_fresh_ddp_resumes_at_step_1_after_the_iteration_it_missed(ddp_job):
    """DDP rebuilds its buckets in its second iteration (two broadcasts, in step 1 here): a
    fresh DDP given the state after step 0 first runs the one iteration the recorded DDP had
    run before step 1 (the part says 0 before its first step), then replays step 1 bit for
    bit, its broadcasts included."""
    job_path, directory = ddp_job
    for rank, report in enumerate(results(directory)):
        assert JobBundle.open(job_path).rank(rank).manifest.distributed.ddp_iterations_before == 0
        assert report["resumed_step_1"] is True


@pytest.mark.parametrize("warm, given", [(1, "model"), (3, "data_parallel")])
def test_a_ddp_job_recorded_in_the_middle_of_training_verifies_and_replays(
    cli, tmp_path, warm, given
):
    """DDP rebuilds its buckets in its second iteration: recorded from its second (the rebuild
    and its two broadcasts in the first recorded step) or a later one (rebuilt: another bucket
    layout), a replay's fresh DDP runs that many iterations first, so the recording verifies
    and replays bit for bit."""
    script = tmp_path / "train.py"
    shutil.copy(TESTS / "midjob_script.py", script)
    done = run_torchrun(script, 2, str(tmp_path / "job.bundle"), str(warm), given)
    assert done.returncode == 0, done.stderr[-3000:]
    job = JobBundle.open(tmp_path / "job.bundle")
    for rank in (0, 1):
        part = job.rank(rank)
        assert part.verified and part.step_indices == [warm, warm + 1]
        assert part.manifest.distributed.ddp_iterations_before == min(warm, 2)
        names = [[m.profiling_name for m in step] for step in part.messages().values()]
        rebuild = ["gloo:broadcast"] * 2 if warm == 1 else []
        assert names == [[*rebuild, "gloo:all_reduce"], ["gloo:all_reduce"]]
    result = cli("replay", tmp_path / "job.bundle", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["verdict"] == "correct"


def test_a_ddp_the_recorder_does_not_know_fails_verification_saying_what_to_do(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(TESTS / "midjob_script.py", script)
    done = run_torchrun(script, 2, str(tmp_path / "job.bundle"), "3", "none")
    assert done.returncode != 0
    assert (
        "the input of collective message 0 (gloo:all_reduce on process group 0 of float32[740]) "
        "differs: the loop's step sends other data than the workload's (if a "
        "DistributedDataParallel trained before this recording began, it issues other "
        "collectives than a fresh one: give it to the Recorder as model= or data_parallel=)"
    ) in done.stderr.replace("\n", " "), done.stderr[-3000:]


def test_a_part_replayed_without_its_peers_is_refused_with_a_hint(ddp_job):
    job_path, _ = ddp_job
    with pytest.raises(SdcReplayError) as refused:
        ReplaySession(JobBundle.open(job_path).rank(1))
    assert refused.value.message.endswith(
        "ranks/000001 is rank 1 of a 2-rank job: its collectives need its peers, and this "
        "process has no process group"
    )
    assert "started by torchrun, after init_process_group" in refused.value.hint


def test_a_job_killed_mid_step_keeps_every_ranks_completed_steps(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(TESTS / "job_script.py", script)
    (tmp_path / "results").mkdir()
    job_path = tmp_path / "job.bundle"
    done = run_torchrun(script, 2, str(job_path), str(tmp_path / "results"), "ddp", "2")
    assert done.returncode != 0  # rank 1 exited with status 17 inside step 2
    assert not job_path.exists()
    job = JobBundle.open(job_path)  # reads job.bundle.partial
    assert job.path == tmp_path / "job.bundle.partial"
    assert not job.complete
    for rank in (0, 1):
        part = job.rank(rank)
        assert not part.complete
        assert part.step_indices == [0, 1]
        assert [len(messages) for messages in part.messages().values()] == [3, 5]


def test_fsdp2_records_and_replays_bit_for_bit_on_two_ranks(tmp_path):
    script = tmp_path / "train.py"
    shutil.copy(TESTS / "job_script.py", script)
    (tmp_path / "results").mkdir()
    done = run_torchrun(script, 2, str(tmp_path / "job.bundle"), str(tmp_path / "results"), "fsdp2")
    assert done.returncode == 0, done.stderr[-3000:]
    job = JobBundle.open(tmp_path / "job.bundle")
    # Root and one block: all-gather both in forward, the block's again in backward, then
    # reduce-scatter the gradients (block, root), then the loop's two all_reduce calls.
    names = ["gloo:_allgather_base"] * 3 + ["gloo:_reduce_scatter_base"] * 2
    names += ["gloo:all_reduce"] * 2
    for rank, report in enumerate(results(tmp_path / "results")):
        part = job.rank(rank)
        assert part.verified
        recorded = part.messages()
        for step in (0, 1):
            assert [m.profiling_name for m in recorded[step]] == names
            assert report["replayed"][str(step)]["signatures_equal"] is True
            assert report["replayed"][str(step)]["messages"] == [
                m.to_json() for m in recorded[step]
            ]
        # The state handed over in a file after step 0 resumes step 1 bit for bit.
        assert report["resumed_step_1"] is True


def test_nccl_settings_are_recorded_switches_and_compared_in_cuda_fingerprints(monkeypatch):
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.delenv("NCCL_CROSS_NIC", raising=False)
    env = determinism.current_switches()["env"]
    assert (env["NCCL_ALGO"], env["NCCL_NVLS_ENABLE"], env["NCCL_CROSS_NIC"]) == ("Tree", "0", None)
    assert determinism.NCCL_SETTINGS == {
        "nccl.algo": "NCCL_ALGO",
        "nccl.proto": "NCCL_PROTO",
        "nccl.min_nchannels": "NCCL_MIN_NCHANNELS",
        "nccl.max_nchannels": "NCCL_MAX_NCHANNELS",
        "nccl.nvls_enable": "NCCL_NVLS_ENABLE",
        "nccl.cross_nic": "NCCL_CROSS_NIC",
    }
    # A CUDA process's fingerprint carries them (_gpu_fingerprint); a CPU one does not.
    assert not any(
        name.startswith("nccl.") for name in determinism.fingerprint(torch.device("cpu"))
    )
    recorded = {"nccl.algo": "Tree", "nccl.nvls_enable": "1", "gpu.name": "H100"}
    here = {**recorded, "nccl.nvls_enable": "0"}
    assert comparable.fingerprint_differences(recorded, here) == [
        "nccl.nvls_enable: recorded '1', here '0'"
    ]


# ---------------------------------------------------------------------------
# The log's own digests are never the step's operators, on whichever thread they run.


def operators_seen(step, message_log: MessageLog | None = None) -> list[str]:
    """The operator calls an OperatorMode names while ``step`` runs (under ``message_log``)."""
    oplog = OperatorLog()
    if message_log is not None:
        message_log.begin_step(0)
    with OperatorMode(torch.nn.Linear(2, 2), None, [oplog], step=0):
        step()
    if message_log is not None:
        message_log.end_step()
    return [record.site.op for record in oplog.records]


def test_a_broadcast_that_completed_before_its_digest_was_attached_adds_no_operator_call(
    lone_rank,
):
    """DDP's bucket rebuild in its second iteration: a broadcast of one integer, often done
    before the log attaches its digest, which then runs at once on the step's own thread (on
    gloo's when it was not done yet: which one depends on the machine's load). Here the call is
    waited for before the log attaches it, every time."""
    log = MessageLog(CPU_ALGORITHM)
    order = torch.tensor([3])  # small enough to be kept exactly: its digest calls operators
    broadcast = torch.ops.c10d.broadcast_.default
    arguments = ([order], lone_rank.boxed(), 0, 0, True, -1)

    def issue_and_complete():
        result = _below_autograd(broadcast, arguments, {})
        result[1].wait()
        return result

    def step():
        (order + 1).sum()
        log.call(LAYOUTS["broadcast_"], issue_and_complete, arguments, {})
        (order * 2).sum()

    step_alone = ["aten.add.Tensor", "aten.sum.default", "aten.mul.Tensor", "aten.sum.default"]
    assert operators_seen(step, log) == step_alone
    assert [(m.profiling_name, m.output_digest) for m in log.messages] == [
        ("gloo:broadcast", "=int64:0000000000000003")
    ]


def test_collectives_under_a_message_log_leave_the_steps_operator_calls_as_they_are(lone_rank):
    """Input digests, outputs digested on any thread, a functional collective's output digested
    when ``wait_tensor`` waits for it: the log's work, not the step's."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as functional

    def step():
        small, large = torch.tensor([1]), torch.arange(8.0)
        for tensor in (small, large):
            dist.all_reduce(tensor)
            dist.broadcast(tensor, 0)
        reduced = functional.all_reduce(torch.tensor([2.0]), "sum", lone_rank)
        (reduced.wait() + small).sum()

    alone = operators_seen(step)
    assert "aten.detach.default" not in alone and "aten.view.dtype" not in alone
    log = MessageLog(CPU_ALGORITHM)
    assert operators_seen(step, log) == alone
    assert [m.profiling_name for m in log.messages] == ["gloo:all_reduce", "gloo:broadcast"] * 2 + [
        "gloo:all_reduce"
    ]
    assert log.messages[-1].output_digest == "=float32:40000000"  # 2.0 summed over one rank


def test_a_collective_the_backend_refuses_shows_the_backends_error_alone(lone_rank):
    """FSDP's PREMUL_SUM on gloo: gloo's Work has no future, and the call's own error (raised
    when it is waited for) is what the person sees, not chained to the log's missing future."""
    import torch.distributed as dist

    log = MessageLog(CPU_ALGORITHM)
    log.begin_step(0)
    try:
        with pytest.raises(RuntimeError, match="PREMUL_SUM with Gloo") as raised:
            work = dist.reduce_scatter_tensor(
                torch.empty(4), torch.ones(4), op=dist._make_nccl_premul_sum(2.0), async_op=True
            )
            work.wait()
    finally:
        log.abandon()
    assert raised.value.__context__ is None
