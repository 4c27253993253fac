"""`sdcreplay demo` (what `make demo` runs) is a drill of its own: its verdicts go to the
ledger in its directory, marked as drills, and it leaves ~/.config/sdcreplay untouched."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from conftest import REPO, _console_script

from sdcreplay.cli.demo import DEFECT
from sdcreplay.ledger.store import Ledger


def test_the_demo_keeps_its_ledger_and_secret_in_its_own_directory(tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("SDCREPLAY_HOME", "SDCREPLAY_LEDGER", "SDCREPLAY_INJECT", "SLURM_JOB_ID")
    }
    out = tmp_path / "demo-out"
    done = subprocess.run(
        [_console_script(), "demo", "--out", str(out)],
        cwd=REPO,
        env={**env, "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(home.iterdir()) == []  # no ~/.config/sdcreplay: neither ledger nor secret
    ledger = out / "ledger.sqlite"
    assert (out / "home" / "secret").is_file()
    said = " ".join(done.stderr.split())
    assert (
        f"Its verdicts are drills (injected faults: no device's state moves) in the ledger {ledger}"
        in said
    )
    with Ledger.open(str(ledger), read_only=True) as opened:
        records = opened.records()
    assert {r.command for r in records} == {"replay", "bisect", "minimize"}
    assert [r for r in records if r.drill != DEFECT or f"[drill: {DEFECT}]" not in r.evidence] == []
    assert len({r.incident for r in records}) == 1
