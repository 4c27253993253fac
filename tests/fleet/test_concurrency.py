"""Jobs that start together never mix evidence: 4 `replay` and 4 `screen` processes started in
the same second on one bundle and one corpus, half with a fault planted on cpu:1 (by --inject
or SDCREPLAY_INJECT), the others clean, each get their own verdict, and the shared ledgers hold
every job's records exactly once: half the jobs (2 replays and 2 screens, one planted, one
clean) write to one SQLite ledger and half to one PostgreSQL ledger, all in the same round.

Once, log directories were named by the second they were made in: processes that started
together shared one and read each other's results (a planted replay said ``match``, clean
screens said ``cpu:1 failed``, a job's record went missing). One round runs in the suite;
``SDCREPLAY_STRESS_ROUNDS=10`` runs ten, ``SDCREPLAY_STRESS_JOBS=8`` starts 8 of each command
(16 processes at once).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections import Counter
from pathlib import Path

from sdcreplay.fleet.corpus import add_tickets
from sdcreplay.ledger.store import Ledger

ROUNDS = int(os.environ.get("SDCREPLAY_STRESS_ROUNDS", "1"))
JOBS = int(os.environ.get("SDCREPLAY_STRESS_JOBS", "4"))  # of each command, per round
DEVICES = ["cpu:0", "cpu:1"]  # the recording and cpu:0 outvote a planted cpu:1
REPLAY_FAULT = (
    "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,phase=forward,step=1,index=3,bit=20,"
    "device=cpu:1"
)
SCREEN_FAULT = "kind=bitflip,op=aten.mm,bit=22,device=cpu:1"


def _plant(index: int, spec: str) -> tuple[list[str], dict[str, str]]:
    """Job ``index``'s fault: by --inject (0, 4), by SDCREPLAY_INJECT (2, 6), or none (odd)."""
    if index % 2:
        return [], {}
    if index % 4 == 0:
        return ["--inject", spec], {}
    return [], {"SDCREPLAY_INJECT": spec}


def _start(exe: str, args: list[str], env: dict[str, str], out: Path) -> subprocess.Popen:
    """Its stdout and stderr go to files: a pipe would also wait for the device processes'
    forkserver, which inherits them and may outlive the command by seconds."""
    full = {**os.environ, **env}
    for name in ("SDCREPLAY_DEBUG", "SDCREPLAY_INJECT", "SDCREPLAY_TRACKER"):
        if name not in env:
            full.pop(name, None)
    with open(f"{out}.stdout", "w") as stdout, open(f"{out}.stderr", "w") as stderr:
        return subprocess.Popen(
            [exe, *args], cwd=out.parent, env=full, stdout=stdout, stderr=stderr
        )


def _ledger_of(index: int, ledgers: list[str]) -> str:
    """The first half of each command's jobs on the first ledger, the second on the other: with
    4 jobs, one ledger gets the --inject plant and the other the SDCREPLAY_INJECT one, each a
    clean job beside it; with 8, each gets both plants and two clean jobs."""
    return ledgers[(index % JOBS) * len(ledgers) // JOBS]


def _round(exe: str, bundle: Path, corpus: Path, ledgers: list[str], first_job: int, cwd: Path):
    """Start every job at once; return [(job, command, planted, exit code, JSON, stderr)]."""
    jobs = []
    for index in range(2 * JOBS):
        command = "replay" if index < JOBS else "screen"
        job = str(first_job + index)
        flags, env = _plant(index % JOBS, REPLAY_FAULT if command == "replay" else SCREEN_FAULT)
        ledger = _ledger_of(index, ledgers)
        devices = [word for label in DEVICES for word in ("--device", label)]
        if command == "replay":
            args = ["replay", str(bundle), *devices, "--timeout", "300"]
        else:
            args = ["screen", str(corpus), *devices, "--budget", "400"]
        env = {**env, "SLURM_JOB_ID": job, "SDCREPLAY_LEDGER": ledger}
        planted = bool(flags or env.get("SDCREPLAY_INJECT"))
        out = cwd / f"job-{job}"
        jobs.append((job, command, planted, _start(exe, [*args, *flags, "--json"], env, out)))
    done = []
    for job, command, planted, process in jobs:
        code = process.wait(timeout=900)
        out = cwd / f"job-{job}"
        stdout, stderr = Path(f"{out}.stdout").read_text(), Path(f"{out}.stderr").read_text()
        done.append((job, command, planted, code, stdout, stderr))
    return done


EXPECTED = {
    ("replay", True): {"cpu:0": "match", "cpu:1": "persistent"},
    ("replay", False): dict.fromkeys(DEVICES, "match"),
    ("screen", True): {"cpu:0": "passed", "cpu:1": "failed"},
    ("screen", False): dict.fromkeys(DEVICES, "passed"),
}


def _check_verdict(command: str, planted: bool, code: int, report: dict) -> None:
    expected = EXPECTED[command, planted]
    if command == "replay":
        verdicts = {row["device"]: row["verdict"] for row in report["devices"]}
        consensus = report["consensus"]
        assert (code, consensus["verdict"], consensus["suspects"], verdicts) == (
            (1, "persistent", ["cpu:1"], expected) if planted else (0, "correct", [], expected)
        )
        fired = {row["device"]: any(row["injected"]) for row in report["devices"]}
        assert fired == {"cpu:0": False, "cpu:1": planted}  # its own task, its own faults
    else:
        statuses = {row["device"]: row["status"] for row in report["devices"]}
        errors = [row["error"] for row in report["devices"] if row["error"]]
        assert (code, report["failed"], statuses) == (
            (1, ["cpu:1"], expected) if planted else (0, [], expected)
        ), (errors, report["seconds"])
        assert report["inject"] == ([SCREEN_FAULT] if planted else [])


def test_jobs_started_at_once_each_get_their_own_verdict_and_every_record_once(
    small_bundle: Path,
    tickets: list[Path],
    ledger_urls: dict[str, str],
    sdcreplay_exe: str,
    tmp_path: Path,
):
    corpus = tmp_path / "corpus"
    add_tickets(corpus, tickets)
    ledgers = list(ledger_urls.values())
    for round_number in range(ROUNDS):
        started = time.monotonic()
        first_job = 1001 + 2 * JOBS * round_number
        done = _round(sdcreplay_exe, small_bundle, corpus, ledgers, first_job, tmp_path)
        log_dirs = []
        expected_records: dict[str, Counter] = {ledger: Counter() for ledger in ledgers}
        for index, (job, command, planted, code, stdout, stderr) in enumerate(done):
            assert stdout, f"round {round_number}, job {job} ({command}): {stderr[-2000:]}"
            report = json.loads(stdout)
            _check_verdict(command, planted, code, report)
            assert "not in the ledger" not in stderr, stderr  # the ledger took every verdict
            log_dirs.append(report["log_dir"])
            for label, verdict in EXPECTED[command, planted].items():
                expected_records[_ledger_of(index, ledgers)][job, command, label, verdict] += 1
        assert len(set(log_dirs)) == len(log_dirs)  # each process had its own
        for backend, url in ledger_urls.items():
            with Ledger.open(url) as ledger:
                written = Counter(
                    (r.job, r.command, r.label, r.verdict)
                    for r in ledger.records()
                    if r.job is not None and first_job <= int(r.job) < first_job + 2 * JOBS
                )
            assert written == expected_records[url], f"round {round_number}, {backend}"
        seconds = time.monotonic() - started
        print(f"round {round_number + 1} of {ROUNDS} passed in {seconds:.0f} s", flush=True)
