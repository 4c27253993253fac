"""`sdcreplay ops JOB --rank R --step N`: a job's rank's calls, each with a spec that `replay JOB
--inject` and `bisect JOB --rank R --inject` take as it is printed (plus the bit to flip and,
for bisect, the suspect device). A DDP job recorded by a user's torchrun script
(tests/job_script.py) and an FSDP2 job (tests/sharded_script.py), each recorded once per
session; a compiled job's kernel specs are listed in tests/recording/test_compiled_loop.py on
the job recorded there."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import SMALL_ARGS

from sdcreplay.bisect.ops import _job_and_rank

TIMEOUT = ["--timeout", "120"]
FLIP = ",index=3,bit=20"


def listed(cli, job: Path, *options: str) -> dict:
    done = cli("ops", job, "--trust-workload", "--step", "1", *options, "--json")
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def origin_of(cli, job: Path, spec: str) -> int:
    """The origin rank of one replica of the job on cpu:0, cpu:1 with ``spec`` injected."""
    done = cli(
        "replay", job, "--trust-workload", "-d", "cpu:0", "-d", "cpu:1", "--inject", spec,
        "--no-ledger", *TIMEOUT, "--json",
    )  # fmt: skip
    assert done.exit_code == 1, done.output
    return json.loads(done.stdout)["origin_rank"]


def bisected(rank_bisect, job: Path, spec: str) -> tuple:
    """bisect --rank 1 on cpu:1 against cpu:0 with ``spec`` planted for cpu:1 (conftest
    ``rank_bisect``: the FSDP2 one is tests/bisect/test_rank.py's too): what it names."""
    report = rank_bisect(job, f"{spec},device=cpu:1")
    return (
        report["rank"], report["step"], report["phase"], report["module"], report["op"],
        report["elements"]["indices"], report["bits"]["histogram"],
    )  # fmt: skip


def test_a_ddp_ranks_spec_from_ops_is_named_by_replay_and_bisect(cli, ddp_job, rank_bisect):
    job, _ = ddp_job
    listing = listed(
        cli, job, "--rank", "1", "--module", "layers.0.attn.wq", "--op", "aten.mm",
        "--phase", "backward",
    )  # fmt: skip
    assert (listing["rank"], listing["coordinates"], listing["alone"]) == (
        1,
        "rank 1 (dp=1)",
        False,
    )
    assert [(c["nth"], c["outputs"], c["spec"]) for c in listing["calls"]] == [
        (
            nth,
            [{"shape": shape, "dtype": "float32"}],
            "kind=bitflip,op=aten.mm.default,module=layers.0.attn.wq,phase=backward,step=1,"
            f"nth={nth},rank=1",
        )
        for nth, shape in ((0, [32, 32]), (1, [16, 32]))  # the weight's gradient, the input's
    ]
    spec = listing["calls"][0]["spec"] + FLIP
    assert origin_of(cli, job, spec) == 1
    assert bisected(rank_bisect, job, spec) == (
        1, 1, "backward", "layers.0.attn.wq", "aten.mm.default", [3], {"20": 1}
    )  # fmt: skip


def test_an_fsdp2_ranks_spec_from_ops_is_named_and_alone_lists_the_same_calls(
    cli, sharded_job, rank_bisect
):
    """FSDP2 (every block and the root fully_shard): the listing among peers and the one of the
    rank alone (its peers' shards from the bundle) name the same calls with the same specs."""
    job = sharded_job("fsdp2", 2)
    among_peers = listed(cli, job, "--rank", "1", "--module", "blocks.1.fc1")
    alone = listed(cli, job, "--rank", "1", "--module", "blocks.1.fc1", "--alone")
    assert alone["alone"] is True and among_peers["coordinates"] == alone["coordinates"]
    named = [
        [(c["spec"], c["outputs"]) for c in listing["calls"]] for listing in (among_peers, alone)
    ]
    assert named[0] == named[1] and named[0]  # (their positions in the step may differ: index)
    (forward,) = [
        c
        for c in among_peers["calls"]
        if (c["op"], c["phase"]) == ("aten.addmm.default", "forward")
    ]
    assert forward["spec"] == (
        "kind=bitflip,op=aten.addmm.default,module=blocks.1.fc1,phase=forward,step=1,nth=0,rank=1"
    )
    assert origin_of(cli, job, forward["spec"] + FLIP) == 1
    assert bisected(rank_bisect, job, forward["spec"] + FLIP) == (
        1, 1, "forward", "blocks.1.fc1", "aten.addmm.default", [3], {"20": 1}
    )  # fmt: skip


def test_a_ranks_part_names_its_job_and_rank(ddp_job):
    job, _ = ddp_job
    found, rank = _job_and_rank(job / "ranks" / "000001", None, 1, False)
    assert found is not None and (found.path, rank) == (job, 1)


def test_ops_on_a_job_without_a_rank_names_the_command_that_lists_one(cli, ddp_job):
    job, _ = ddp_job
    done = cli("ops", job, "--step", "1")
    assert done.exit_code == 3
    assert f"Error: {job} is a job of 2 ranks: say whose calls to list" in done.stderr
    hint = " ".join(done.stderr[done.stderr.index("Hint:") :].split())
    assert f"`sdcreplay ops {job} --rank R --step 1`, R in 0..1" in hint


def test_rank_on_a_single_process_bundle_is_refused(cli, small_bundle):
    done = cli("ops", small_bundle, "--rank", "1", "--step", "1")
    assert done.exit_code == 3
    assert "is a single process's bundle" in done.stderr
    assert f"`sdcreplay ops {small_bundle} --step 1`" in " ".join(done.stderr.split())


def test_a_one_rank_job_is_its_rank_0_without_rank(cli, tmp_path):
    """A one-process torchrun run is a job of one rank: ops and bisect take it as rank 0."""
    from sdcreplay.bisect.rank import job_to_bisect

    job = tmp_path / "one.bundle"
    done = cli("record", "builtin:tiny-llama", "--nproc", "1", "--steps", "2", *SMALL_ARGS,
               "--out", job)  # fmt: skip
    assert done.exit_code == 0, done.output
    found, rank = _job_and_rank(job, None, 1, False)
    assert found is not None and (found.path, rank) == (job, 0)
    assert job_to_bisect(job, None, None, 1).world_size == 1
    assert job_to_bisect(job, 0, None, 1).world_size == 1
