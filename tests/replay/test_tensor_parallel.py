"""Functional collectives (DTensor tensor parallelism) in the message log, on real
torch.distributed (gloo, 2 ranks as torchrun starts them, each job with a timeout).

A user's script (tests/tp_script.py, copied into tmp_path) records 2 steps of an MLP split by
``parallelize_module`` (ColwiseParallel fc1, RowwiseParallel fc2): the forward's functional
all_reduce and the loop's two logging all_reduces are logged like c10d collectives, replay bit
for bit, are enforced in order, and name the rank whose input to one was corrupted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import TESTS, run_torchrun

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.capture.collectives import _digest
from sdcreplay.capture.message import Message

TIMEOUT = ["--timeout", "60"]
# The forward addmm of fc1 (the first Linear) on rank 1 of the second replica, step 1.
FAULT = "kind=bitflip,op=aten.addmm,phase=forward,step=1,index=3,bit=22,rank=1,device=cpu:3"


@pytest.fixture(scope="module")
def tp_job(tmp_path_factory) -> tuple[Path, list[dict]]:
    """(job bundle, each rank's results) of tests/tp_script.py on 2 ranks."""
    root = tmp_path_factory.mktemp("tp-job")
    script = root / "train.py"
    shutil.copy(TESTS / "tp_script.py", script)
    shutil.copy(TESTS / "job_script.py", root)  # its replay_order_errors
    results = root / "results"
    results.mkdir()
    done = run_torchrun(script, 2, str(root / "job.bundle"), str(results), timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((results / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    return root / "job.bundle", ranks


def run_json(cli, *args, code: int) -> dict:
    result = cli(*args, "--json")
    assert result.exit_code == code, result.output
    return json.loads(result.stdout)


def test_the_functional_all_reduce_of_each_tp_step_is_logged_on_every_rank(tp_job):
    job_path, _ = tp_job
    job = JobBundle.open(job_path)
    logs = [job.rank(rank).messages() for rank in (0, 1)]
    for log in logs:
        assert sorted(log) == [0, 1]
        for messages in log.values():  # fc2's partial outputs [rows, width], loss, rows
            assert [m.profiling_name for m in messages] == ["gloo:all_reduce"] * 3
            assert [(m.record_id, m.collective_seq_id, m.op_id) for m in messages] == [
                (i, i, i) for i in range(3)
            ]
            assert [(m.input_sizes, m.output_sizes) for m in messages] == [
                ([[4, 8]], [[4, 8]]),
                ([[1]], [[1]]),
                ([[1]], [[1]]),
            ]
            assert [m.input_dtypes for m in messages] == [["float32"], ["float32"], ["int64"]]
            assert {(m.pg_id, m.process_group) for m in messages} == {(0, "0")}
            assert (messages[2].input_digest, messages[2].output_digest) == (
                "=int64:0000000000000004",  # 4 rows on each rank, 8 in all
                "=int64:0000000000000008",
            )
    for step in (0, 1):
        for position, differ in ((0, True), (1, False)):  # fc2's halves, the same loss
            sent = [log[step][position] for log in logs]
            assert (sent[0].input_digest != sent[1].input_digest) is differ
            assert sent[0].output_digest == sent[1].output_digest is not None  # the same sum


def test_functional_collectives_in_another_order_are_a_message_order_error(tp_job):
    _, ranks = tp_job
    program = " (another collective order: a different program, not a device's arithmetic)"
    for rank in ranks:
        assert rank["order_errors"] == {
            "swapped": "step 0, message record_id 1: the record has gloo:all_reduce on process "
            "group 0 of float32[1], the replay issues gloo:all_reduce on process group 0 of "
            "int64[1]" + program,
            "extra": "step 0, message record_id 3: the record's step has 3 messages, the "
            "replay issues gloo:all_reduce on process group 0 of float32[2] as one more" + program,
        }


def test_every_functional_collective_is_logged_with_its_waited_output(tp_job):
    """One call of each on ``arange(4) + rank``; the last one nobody waited for is waited for
    and digested when the step ends."""
    _, ranks = tp_job
    x = [torch.arange(4.0) + rank for rank in (0, 1)]
    names = [
        "_allgather_base",
        "_reduce_scatter_base",
        "all_to_all_base",
        "all_reduce",
        "allreduce_coalesced",
        "broadcast",
        "all_reduce",
    ]
    for rank, report in enumerate(ranks):
        messages = [Message.from_json(m) for m in report["functional"]]
        assert [m.profiling_name for m in messages] == [f"gloo:{name}" for name in names]
        assert [(m.record_id, m.collective_seq_id) for m in messages] == [(i, i) for i in range(7)]
        received = [1, 3][rank]  # all_to_all: rank 0 receives 1 element of each rank, rank 1 3
        assert [m.output_sizes for m in messages] == [
            [[8]], [[2]], [[2 * received]], [[4]], [[4], [2]], [[4]], [[4]],
        ]  # fmt: skip
        assert [m.input_sizes for m in messages[4:5]] == [[[4], [2]]]
        alone = [m.input_digest for m in messages if m.profiling_name != "gloo:allreduce_coalesced"]
        assert set(alone) == {_digest([x[rank]])}
        assert messages[4].input_digest == _digest([x[rank], 2 * x[rank][:2]])
        total = x[0] + x[1]
        outputs = [
            torch.cat(x),
            total[2 * rank : 2 * rank + 2],
            torch.cat([part[:1] if rank == 0 else part[1:] for part in x]),  # splits [1, 3]
            total,
            [total, 2 * total[:2]],
            x[1],
            x[1],  # max
        ]  # fmt: skip
        assert [m.output_digest for m in messages] == [
            _digest(out if isinstance(out, list) else [out]) for out in outputs
        ]


def test_a_compiled_functions_functional_collective_is_logged_once_per_call(tp_job):
    _, ranks = tp_job
    for report in ranks:
        messages = [Message.from_json(m) for m in report["compiled"]]
        assert [(m.profiling_name, m.record_id, m.input_sizes) for m in messages] == [
            ("gloo:all_reduce", 0, [[3]]),
            ("gloo:all_reduce", 1, [[3]]),
        ]
        assert {(m.input_digest, m.output_digest) for m in messages} == {
            (_digest([torch.full((3,), 2.0)]), _digest([torch.full((3,), 4.0)]))
        }


def test_a_tp_job_replays_bit_for_bit_its_functional_collectives_included(cli, tp_job, tmp_path):
    job_path, _ = tp_job
    logs = tmp_path / "logs"
    replayed = run_json(
        cli, "replay", job_path, "--trust-workload", "--logs", logs, *TIMEOUT, code=0
    )
    assert replayed["verdict"] == "correct" and replayed["failed"] == []
    assert replayed["origin_rank"] is None and replayed["first_divergent_message"] is None
    job = JobBundle.open(job_path)
    for rank in (0, 1):
        written = json.loads((logs / "replica0" / f"rank{rank}.r0.messages.json").read_text())
        messages = {
            int(s): [Message.from_json(m) for m in ms] for s, ms in written["steps"].items()
        }
        assert messages == job.rank(rank).messages()


def test_a_bitflip_on_rank_1_of_a_tp_job_is_named_its_origin_at_the_all_reduce(cli, tp_job):
    job_path, _ = tp_job
    devices = [arg for n in range(4) for arg in ("-d", f"cpu:{n}")]
    replayed = run_json(
        cli, "replay", job_path, "--trust-workload", *devices, "--inject", FAULT, *TIMEOUT, code=1
    )
    assert replayed["verdict"] == "persistent" and replayed["suspects"] == ["cpu:3"]
    assert (replayed["origin_rank"], replayed["spread_ranks"]) == (1, [0])
    first = replayed["first_divergent_message"]
    assert {k: first[k] for k in ("rank", "step", "record_id", "profiling_name", "which")} == {
        "rank": 1,
        "step": 1,
        "record_id": 0,
        "profiling_name": "gloo:all_reduce",
        "which": "input",
    }
    assert (first["input_differs"], first["output_differs"]) == ([1], [0, 1])
