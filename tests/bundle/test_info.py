"""`sdcreplay info JOB --rank R`: one rank's part described in its job (its place in the mesh,
its steps with their messages), the same as `info JOB/ranks/00000R`; on the DDP job of
tests/job_script.py."""

from __future__ import annotations

import json

from sdcreplay.bundle.job_bundle import JobBundle


def test_info_of_a_jobs_rank_gives_its_coordinates_steps_and_messages(cli, ddp_job):
    job, _ = ddp_job
    result = cli("info", job, "--rank", "1", "--json")
    assert result.exit_code == 0, result.output
    about = json.loads(result.stdout)
    part = JobBundle.open(job).rank(1)
    messages = part.messages()
    assert about["bundle"] == str(part.path) and about["job"] == str(job)
    assert (about["rank"], about["ranks"], about["coordinates"]) == (1, 2, "rank 1 (dp=1)")
    assert [(s["index"], s["messages"]) for s in about["steps"]] == [
        (step.index, len(messages[step.index])) for step in part.steps
    ]
    assert about["messages"] == sum(map(len, messages.values())) and "parts" not in about
    assert about["entries"] == part.signature_log().entry_count()
    by_part = cli("info", job / "ranks" / "000001", "--json")
    assert json.loads(by_part.stdout) == about
    shown = cli("info", job, "--rank", "1", env={"COLUMNS": "300"})  # no row wraps the path
    table = " ".join(shown.stderr.replace("│", " ").split())
    assert f"job {job}: rank 1 of 2 coordinates rank 1 (dp=1)" in table


def test_info_refuses_a_rank_the_job_lacks_and_a_rank_of_a_single_process(
    cli, ddp_job, small_bundle
):
    job, _ = ddp_job
    missing = cli("info", job, "--rank", "2")
    assert missing.exit_code == 3
    assert f"--rank 2: the job {job} has ranks 0..1" in missing.stderr
    single = cli("info", small_bundle, "--rank", "0")
    assert single.exit_code == 3
    assert f"`sdcreplay info {small_bundle}`" in " ".join(single.stderr.split())
