"""The peer vote of a same-batch replay on hand-made logs: a strict majority names the odd
rank at its first odd entry, shards judge nobody, a tensor-parallel partner is spread, the
source group is held to the record up to its first reduction, and two peers are decided by the
record or undecided."""

from __future__ import annotations

from sdcreplay.bundle.layout import ParallelLayout
from sdcreplay.capture.message import Message
from sdcreplay.capture.signature import SignatureLog
from sdcreplay.compare.peers import (
    OddEntry,
    first_odd_entries,
    peer_vote,
    record_prefix_divergence,
)


def log(*values: str, step: int = 0) -> SignatureLog:
    return SignatureLog(meta={}, steps={step: [(f"e{i}", v) for i, v in enumerate(values)]})


def test_the_minority_is_odd_at_its_first_odd_entry_and_shards_judge_nobody():
    layout = ParallelLayout.data_parallel_world(4, "shard")
    logs = {
        0: log("a", "s0", "c"),
        1: log("a", "s1", "c"),
        2: log("a", "s2", "X"),  # its shard differs as every shard does; then it is odd
        3: log("a", "s3", "c"),
    }
    odd, unjudged = first_odd_entries(layout, logs)
    assert list(odd) == [2] and (odd[2].position, odd[2].agreeing, odd[2].peers) == (2, 3, 4)
    assert unjudged == 1
    vote = peer_vote(layout, logs)
    assert (vote.verdict, vote.origins, vote.spread_from) == ("persistent", [2], {})


def test_clean_peers_are_correct():
    layout = ParallelLayout.data_parallel_world(3)
    vote = peer_vote(layout, {rank: log("a", "b") for rank in range(3)})
    assert (vote.verdict, vote.odd, vote.unjudged) == ("correct", {}, 0)


def test_a_tensor_parallel_partner_is_spread_from_the_earlier_odd_rank():
    layout = ParallelLayout.grid([("dp", 3, "replicate"), ("tp", 2, "tensor")])
    logs = {rank: log("a", "b", "c") for rank in range(6)}
    logs[2] = log("a", "X", "Y")  # (dp=1, tp=0): wrong first
    logs[3] = log("a", "b", "Z")  # (dp=1, tp=1): its partner's all-reduce brought it
    vote = peer_vote(layout, logs)
    assert vote.origins == [2] and vote.spread_from == {3: 2}


def test_two_peers_are_decided_by_the_record_or_undecided():
    layout = ParallelLayout.grid([("dp", 2, "replicate"), ("tp", 2, "tensor")])
    logs = {rank: log("a", "b") for rank in range(4)}
    logs[2] = log("a", "X")  # (dp=1, tp=0) against rank 0: one against one
    tie = peer_vote(layout, logs)
    assert (tie.verdict, tie.origins, tie.unjudged) == ("undecided", [], 1)
    left = OddEntry(0, 3, "collective:0#3:gloo:all_reduce.input", 1, 1, against="record")
    decided = peer_vote(layout, logs, {2: left})
    assert (decided.verdict, decided.origins, decided.odd) == ("persistent", [2], {2: left})
    # each data-parallel group has its own tensor-parallel group: peers' names differ in it
    grouped = {
        rank: SignatureLog(meta={}, steps={0: [(f"collective:{rank // 2 + 1}#0:all_reduce", "v")]})
        for rank in range(4)
    }
    assert peer_vote(layout, grouped).verdict == "correct"
    shards = ParallelLayout.data_parallel_world(2, "shard")  # a shard differs, no tie
    assert peer_vote(shards, {0: log("s0"), 1: log("s1")}).verdict == "correct"


def message(op_id: int, given: str, got: str) -> Message:
    return Message(
        step=0, record_id=op_id, pg_id=0, process_group="0", collective_seq_id=op_id,
        p2p_seq_id=None, op_id=op_id, profiling_name="gloo:all_reduce", input_sizes=[[2]],
        input_dtypes=["float32"], output_sizes=[[2]], output_dtypes=["float32"],
        input_digest=given, output_digest=got,
    )  # fmt: skip


def test_the_record_judges_inputs_up_to_the_first_output_it_does_not_share():
    recorded = {0: [message(0, "i0", "o0"), message(1, "i1", "o1"), message(2, "i2", "o2")]}
    same = {0: [message(0, "i0", "o0"), message(1, "i1", "other"), message(2, "x", "y")]}
    assert record_prefix_divergence(recorded, same, 0) is None  # message 2 is past it
    wrong = {0: [message(0, "i0", "o0"), message(1, "bad", "other")]}
    position, found = record_prefix_divergence(recorded, wrong, 0)
    assert (position, found.op_id) == (1, 1)


def test_the_phases_refuse_what_they_cannot_do(cli, small_bundle):
    single = cli("replay", small_bundle, "--same-batch")
    assert single.exit_code == 3 and "for a job bundle" in single.stderr
    assert "Hint:" in single.stderr and "Traceback" not in single.stderr
    both = cli("bisect", small_bundle, "--alone", "--suspect", "cpu:1")
    assert both.exit_code == 3 and "--alone is for a job bundle" in both.stderr
