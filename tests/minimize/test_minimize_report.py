"""minimize on a job's report, as docs/minimize.md gives it: ``bisect JOB --rank 1`` (among its
peers, and ``--alone``) names a planted call on rank 1 of a 2-rank DDP and a 2-rank FSDP2
tiny-llama job; minimize measures it alone, shrinks it and writes a ticket that names the job,
the rank, its coordinates and the collectives around the call, whose repro.py fails on the
planted device and passes on another; corpus add and screen take that ticket.

One job per parallelism and its bisect among the peers, made once for the whole run
(tests/conftest.py: ``builtin_job``, ``rank_bisect``); the ``--alone`` bisect and the tickets
once for the module.
"""

from __future__ import annotations

import json
import re
import runpy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import RANK_FAULT, preserved_global_state
from typer.testing import CliRunner

from sdcreplay.bundle.job_bundle import JobBundle
from sdcreplay.cli import app

FAULT = RANK_FAULT
TRIALS = ["--trials", "20", "--good-trials", "2"]


def invoke(*args) -> tuple[int, dict, str]:
    result = CliRunner().invoke(
        app, [str(arg) for arg in args], env={"SDCREPLAY_DEBUG": None, "SDCREPLAY_INJECT": None}
    )
    return result.exit_code, json.loads(result.stdout or "{}"), result.stderr


@dataclass
class Job:
    """A recorded job, its two bisect reports of rank 1 and the two tickets minimize wrote."""

    parallel: str
    bundle: Path
    reports: dict[str, dict] = field(default_factory=dict)  # peers, alone -> report.json
    tickets: dict[str, tuple[dict, Path]] = field(default_factory=dict)  # -> result, directory


@pytest.fixture(scope="module")
def made(tmp_path_factory, builtin_job, rank_bisect):
    """``made(parallel)``: the run's shared job (conftest ``builtin_job``) and its two bisect
    reports of rank 1 (``rank_bisect``: among its peers, shared with tests/bisect/test_rank.py,
    and ``--alone``), minimized once per module."""
    jobs: dict[str, Job] = {}

    def make(parallel: str) -> Job:
        if parallel in jobs:
            return jobs[parallel]
        bundle = builtin_job(parallel).out
        job = jobs[parallel] = Job(parallel, bundle)
        tickets = tmp_path_factory.mktemp(parallel)
        for how, extra in (("peers", []), ("alone", ["--alone"])):
            report = job.reports[how] = rank_bisect(bundle, FAULT, *extra)
            ticket = tickets / f"{how}.ticket"
            code, result, stderr = invoke(
                "minimize", report["report"], *TRIALS, "--inject", FAULT, "--out", ticket,
                "--no-ledger", "--json",
            )  # fmt: skip
            assert code == 1, stderr
            job.tickets[how] = (result, ticket)
        return job

    return make


EACH = [(parallel, how) for parallel in ("ddp", "fsdp2") for how in ("peers", "alone")]


@pytest.mark.parametrize(("parallel", "how"), EACH)
def test_bisect_names_the_planted_call_on_rank_1(made, parallel, how):
    report = made(parallel).reports[how]
    site = (report["rank"], report["alone"], report["step"], report["phase"], report["op"])
    assert site == (1, how == "alone", 1, "backward", "aten.mm.default")
    assert report["module"] == "output" and report["isolated"] == "kernel"
    assert (report["elements"]["indices"], report["bits"]["histogram"]) == ([3], {"20": 1})


@pytest.mark.parametrize(("parallel", "how"), EACH)
def test_minimize_measures_shrinks_and_names_the_job(made, parallel, how):
    job = made(parallel)
    bundle = job.bundle
    result, ticket = job.tickets[how]
    assert (result["op"], result["device"], result["reference"]) == (
        "aten.mm.default", "cpu:1", "cpu:0",
    )  # fmt: skip
    assert (result["failures"], result["trials"], result["reference_failures"]) == (20, 20, 0)
    assert result["ci95"][0] > 0.8 and result["reference_ci95"][1] < 0.2
    assert result["shrink"]["status"] == "shrunk"
    assert result["input_shapes_minimal"] != result["input_shapes_original"]
    assert result["data_dependent"] is not None and result["minimal"]["failures"] > 0
    assert result["bits"]["histogram"] == {"20": 1}
    doc = json.loads((ticket / "ticket.json").read_text())
    layout = JobBundle.open(bundle).layout
    assert layout is not None
    expected_job = {
        "bundle": str(bundle),
        "rank": 1,
        "world_size": 2,
        "backend": "gloo",
        "mesh": layout.shape(),
        "coordinates": layout.coordinates_of(1),
        "where": layout.describe(1),
        "alone": how == "alone",
    }
    assert {key: doc["job"][key] for key in expected_job} == expected_job
    assert list(layout.coordinates_of(1).values()) == [1]
    # the collectives around the call, from rank 1's recorded message log of step 1
    messages = JobBundle.open(bundle).rank(1).messages()[1]
    around = doc["job"]["collectives"]
    assert around["in_step"] == len(messages) and 0 <= around["issued_before"] <= len(messages)
    before = messages[around["issued_before"] - 1] if around["issued_before"] else None
    after = messages[around["issued_before"]] if around["issued_before"] < len(messages) else None
    assert around["before"] == (before and _shown(before))
    assert around["after"] == (after and _shown(after))
    # found alike among the peers and alone (where the collectives are this process's own)
    assert around == job.reports["peers"]["collectives"] == job.reports["alone"]["collectives"]
    # backward of the head: DDP's gradient all-reduces, FSDP2's reduce-scatters come after it
    reduction = {"ddp": "gloo:all_reduce", "fsdp2": "gloo:_reduce_scatter_base"}[job.parallel]
    assert after is not None and after.profiling_name == reduction
    markdown = (ticket / "ticket.md").read_text()
    assert "## In the job" in markdown and f"| rank | {layout.describe(1)} |" in markdown
    assert f"collective after the call | {after.brief()}" in markdown


def _shown(message) -> dict:
    return {
        "record_id": message.record_id,
        "profiling_name": message.profiling_name,
        "process_group": message.process_group,
        "message": message.brief(),
    }


def run_repro(ticket: Path, device: str, monkeypatch, capsys) -> tuple[int, str]:
    """The ticket's own repro.py, ``--device D --trials 5`` with the drill's
    ``SDCREPLAY_INJECT``, run in this process (tests/minimize/test_ticket.py runs one where only
    torch and h5py exist): its exit status and output."""
    monkeypatch.setenv("SDCREPLAY_INJECT", FAULT)
    monkeypatch.setattr(sys, "argv", ["repro.py", "--device", device, "--trials", "5"])
    with preserved_global_state():
        code = runpy.run_path(str(ticket / "repro.py"))["main"]()
    return code, capsys.readouterr().out


@pytest.mark.parametrize(("parallel", "how"), EACH)
def test_the_tickets_repro_fails_on_the_planted_device_and_passes_on_another(
    made, parallel, how, monkeypatch, capsys
):
    """The drill's spec names rank 1: the ticket's inputs.h5 holds the rank, so it fires in
    repro.py, a process in no job, as it did on the rank."""
    _, ticket = made(parallel).tickets[how]
    code, output = run_repro(ticket, "cpu:1", monkeypatch, capsys)
    assert code == 1, output
    assert "failed 5 of 5" in output and "XOR mask 0x00100000" in output
    code, output = run_repro(ticket, "cpu:0", monkeypatch, capsys)
    assert code == 0 and "failed 0 of 5" in output, output


def test_corpus_add_and_screen_take_the_job_tickets(made, tmp_path, run_exe):
    """The DDP and FSDP2 tickets: one defect class (the same operator, minimal shapes, dtype and
    bit), so the second is a duplicate; one screen (its budget runs from its process's start: a
    process of its own)."""
    tickets = [made(parallel).tickets["peers"][1] for parallel in ("ddp", "fsdp2")]
    corpus = tmp_path / "corpus"
    code, added, stderr = invoke("corpus", "add", corpus, *tickets, "--json")
    assert code == 0, stderr
    assert [(entry["op"], entry["drill"]) for entry in added["added"]] == [
        ("aten.mm.default", True)
    ]
    assert [entry["ticket"] for entry in added["duplicates"]] == [str(tickets[1].resolve())]
    done = run_exe(
        "screen", corpus, "-d", "cpu:0", "-d", "cpu:1", "--inject", FAULT, "--budget", "120",
        "--no-ledger", "--json",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    screened = json.loads(done.stdout)
    outcomes = {device["device"]: device for device in screened["devices"]}
    assert outcomes["cpu:0"]["status"] == "passed" and outcomes["cpu:0"]["tickets_passed"] == 1
    assert outcomes["cpu:1"]["status"] == "failed"
    failure = outcomes["cpu:1"]["failure"]
    assert failure["ticket"]["key"] == added["added"][0]["key"]  # the first ticket, at once
    assert (failure["element"], failure["bits"], failure["xor"]) == (3, "20", "00100000")


def test_minimize_says_where_in_the_job_the_call_ran(made, tmp_path):
    report = made("ddp").reports["peers"]
    result = CliRunner().invoke(
        app,
        [
            "minimize", report["report"], "--trials", "5", "--good-trials", "1", "--inject",
            FAULT, "--out", str(tmp_path / "t"), "--no-ledger",
        ],
        env={"SDCREPLAY_DEBUG": None, "SDCREPLAY_INJECT": None, "COLUMNS": "200"},
    )  # fmt: skip
    assert result.exit_code == 1, result.stderr
    assert re.search(
        rf"in the job +│ rank 1 \(dp=1\) of {re.escape(report['bundle'])} ", result.stderr
    )
