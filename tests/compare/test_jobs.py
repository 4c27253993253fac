"""`sdcreplay diff` on a job's pieces: two ranks' parts, a rank's part or replay log against the
job, and a job replay's log directory against the job. The DDP job of tests/job_script.py is
replayed once for this module with a bit flipped on rank 1 (its weight gradient of
layers.0.attn.wq in step 1), so each comparison has a planted answer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.compare.jobs import JobComparison, diff

FAULT = (
    "kind=bitflip,op=aten.mm.default,module=layers.0.attn.wq,phase=backward,step=1,nth=0,"
    "rank=1,index=3,bit=20"
)
PLANTED = "grad:layers.0.attn.wq.weight"


@pytest.fixture(scope="module")
def replayed(ddp_job, tmp_path_factory) -> tuple[Path, Path]:
    """(the job, the log directory of one replica replayed with FAULT)."""
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    job, _ = ddp_job
    logs = tmp_path_factory.mktemp("replay") / "logs"
    done = CliRunner().invoke(
        app,
        [
            "replay", str(job), "--trust-workload", "-d", "cpu:0", "-d", "cpu:1",
            "--inject", FAULT, "--logs", str(logs), "--no-ledger", "--json",
        ],
    )  # fmt: skip
    assert done.exit_code == 1, done.output
    assert json.loads(done.stdout)["origin_rank"] == 1
    return job, logs


def test_two_ranks_of_a_ddp_job_differ_only_in_what_each_computed_before_the_all_reduce(ddp_job):
    """Rank 0 against rank 1, each with its messages among its entries: each rank's own batch
    makes its forward, loss and the collectives' inputs differ; every collective's output (the
    all_reduce's sum, the broadcast) and every parameter after the step are the same."""
    job, _ = ddp_job
    comparison = diff(job / "ranks" / "000000", job / "ranks" / "000001")
    assert comparison.ranks == [0, 1] and not comparison.identical
    part = JobBundle.open(job).rank(0)
    messages = sum(map(len, part.messages().values()))
    assert comparison.entries == part.signature_log().entry_count() + 2 * messages
    names = {d.name for d in comparison.divergences}
    collectives = {name for name in names if name.startswith("collective:")}
    assert collectives and all(name.endswith(".input") for name in collectives)
    assert not any(name.startswith("param:") for name in names)


def test_a_job_replays_log_directory_is_compared_with_the_job_rank_by_rank(cli, replayed):
    job, logs = replayed
    result = cli("diff", job, logs, "--json")
    assert result.exit_code == 1, result.output
    compared = json.loads(result.stdout)
    assert (compared["job"], compared["origin_rank"], compared["spread_ranks"]) == (True, 1, [0])
    assert compared["ranks"][1]["first_divergence"]["name"] == PLANTED


def test_a_ranks_replay_log_is_compared_with_its_rank_of_the_job(replayed):
    job, logs = replayed
    for record in (job, job / "ranks" / "000001"):
        comparison = diff(record, logs / "replica0" / "rank1.r0.sig.zst")
        assert not isinstance(comparison, JobComparison)
        assert comparison.ranks == [1, 1]
        assert comparison.first is not None
        assert (comparison.first.step, comparison.first.name) == (1, PLANTED)
        assert any(d.name.startswith("collective:") for d in comparison.divergences)


def test_a_log_directory_of_several_replicas_asks_which(cli, replayed, tmp_path):
    job, logs = replayed
    several = tmp_path / "logs"
    for replica in ("replica0", "replica1"):
        shutil.copytree(logs / "replica0", several / replica)
    result = cli("diff", job, several)
    assert result.exit_code == 3
    assert f"{several} holds the logs of 2 replicas of a job replay" in result.stderr
    assert f"Name one: {several / 'replica0'} or {several / 'replica1'}." in " ".join(
        result.stderr.split()
    )
