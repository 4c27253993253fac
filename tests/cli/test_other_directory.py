"""Paths a person types are theirs: every command run from another directory than the recording's,
with relative paths, as the console script in a real process (issue 39, item 5).

A script-mode bundle's device processes move to the recorded directory before they read the
bundle or write a result; a relative bundle, ``--logs`` or ``--out`` must still name what the
person meant, in the directory the command ran in. Each command's paths come back as typed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TESTS

SPEC = "kind=bitflip,op=aten.mm,step=1,index=3,bit=12,device=cpu:1"
NO_LEDGER = {"SDCREPLAY_LEDGER": "off", "COLUMNS": "200"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def places(tmp_path_factory, _small_bundle_template: Path) -> tuple[Path, Path]:
    """(where the script recorded, where the person works): ``p.bundle``, examples/
    train_script.py recorded in the first with a relative ``--out``, moved to the second (a
    path resolved in the recorded directory finds nothing), and ``b.bundle``, a built-in
    workload's."""
    recorded = tmp_path_factory.mktemp("recorded")
    shutil.copy(TESTS.parent / "examples" / "train_script.py", recorded)
    command = [sys.executable, "train_script.py", "--out", "p.bundle", "--steps", "2"]
    command += ["--micro-batches", "1", "--hidden", "8"]
    done = subprocess.run(command, cwd=recorded, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    shutil.move(recorded / "p.bundle", elsewhere / "p.bundle")
    shutil.copytree(_small_bundle_template, elsewhere / "b.bundle")
    return recorded, elsewhere


@pytest.fixture(scope="module")
def run(places, sdcreplay_exe: str):
    def run(*args: str, env: dict | None = None, cwd: Path | None = None):
        full = {**os.environ, **NO_LEDGER, **(env or {})}
        full.pop("SDCREPLAY_DEBUG", None)
        return subprocess.run(
            [sdcreplay_exe, *args], cwd=cwd or places[1], env=full, capture_output=True,
            text=True, timeout=600,
        )  # fmt: skip

    return run


def _partials(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if path.name.endswith(".partial"))


@pytest.mark.parametrize("bundle", ["p.bundle", "b.bundle"])
def test_replay_ops_info_and_diff_take_relative_paths(places, run, bundle: str):
    recorded, elsewhere = places
    logs = f"logs-{bundle.split('.')[0]}"
    done = run("replay", bundle, "-d", "cpu:0", "-d", "cpu:1", "--logs", logs, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert (report["verdict"], report["consensus"]["verdict"]) == ("correct", "correct")
    assert (report["bundle"], report["log_dir"]) == (bundle, logs)
    assert [d["logs"] for d in report["devices"]] == [
        [f"{logs}/cpu-0.r0.sig.zst"],
        [f"{logs}/cpu-1.r0.sig.zst"],
    ]  # as typed, though the device processes wrote them in the recorded directory
    assert (elsewhere / logs / "cpu-1.r0.sig.zst").is_file()

    if bundle == "p.bundle":  # in-process commands: only a script's replay moves elsewhere
        listed = run("ops", bundle, "--step", "1")
        assert listed.returncode == 0, listed.stderr[-3000:]
        assert "aten.mm.default" in listed.stderr + listed.stdout
        compared = run("diff", bundle, f"{logs}/cpu-1.r0.sig.zst")
        assert compared.returncode == 0, compared.stderr[-3000:]
        assert "identical" in compared.stderr + compared.stdout

    described = run("info", bundle)
    assert described.returncode == 0, described.stderr[-3000:]
    (row,) = [line for line in described.stderr.splitlines() if "│ workload" in line]
    named = row.split("│")[2].strip()
    if bundle == "p.bundle":  # the recorded command, not a workload reference
        script = recorded / "train_script.py"
        assert named == f"script {script} --out p.bundle --steps 2 --micro-batches 1 --hidden 8"
    else:
        assert named.startswith("builtin:tiny-llama (layers=1, dim=32")


def test_bisect_and_minimize_write_where_the_command_runs(places, run):
    recorded, elsewhere = places
    found = run(
        "bisect", "p.bundle", "--suspect", "cpu:1", "--reference", "cpu:0", "--inject", SPEC,
        "--out", "bis", "--json",
    )  # fmt: skip
    assert found.returncode == 1, found.stderr[-3000:]
    report = json.loads(found.stdout)
    assert (report["step"], report["module"], report["op"], report["isolated"]) == (
        1,
        "out",
        "aten.mm.default",
        "kernel",
    )
    assert report["elements"]["indices"] == [3] and report["bits"]["histogram"] == {"12": 1}
    assert (report["report"], report["bundle"]) == ("bis", "p.bundle")
    assert report["replay"]["log_dir"] == "bis/work/replay"
    assert (elsewhere / "bis" / "report.json").is_file() and _partials(elsewhere) == []

    # From a third directory: the report's relative bundle is found where bisect ran.
    report_dir = os.path.relpath(elsewhere / "bis", recorded)
    shrunk = run(
        "minimize", report_dir, "--inject", SPEC, "--trials", "5", "--out", "ticket", "--json",
        cwd=recorded,
    )  # fmt: skip
    assert shrunk.returncode == 1, shrunk.stderr[-3000:]
    ticket = json.loads(shrunk.stdout)
    assert (ticket["op"], ticket["trials"], ticket["failures"]) == ("aten.mm.default", 5, 5)
    assert not [w for w in ticket["warnings"] if "bundle cannot be read" in w], ticket["warnings"]
    assert (recorded / "ticket" / "repro.py").is_file() and _partials(recorded) == []


def test_a_failed_bisect_says_what_the_device_said_and_leaves_no_partial_report(places, run):
    _, elsewhere = places
    planted = {"SDCREPLAY_TEST_INTERNAL_ERROR": "sdcreplay.replay.session:run_replay_task"}
    failed = run(
        "bisect", "p.bundle", "--suspect", "cpu:1", "--reference", "cpu:0", "--out", "failed",
        env=planted,
    )  # fmt: skip
    assert failed.returncode == 3, failed.stderr[-3000:]
    error = next(line for line in failed.stderr.splitlines() if line.startswith("Error: "))
    assert error.startswith("Error: every device failed: internal error in sdcreplay")
    assert error.endswith(
        "RuntimeError: a failure planted by SDCREPLAY_TEST_INTERNAL_ERROR (a test)"
    )
    assert not (elsewhere / "failed").exists() and _partials(elsewhere) == []
