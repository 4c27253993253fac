"""What the README's walkthrough writes into a checkout stays out of `git status`."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from conftest import REPO

WRITTEN = [
    "traces/run.bundle/manifest.json",
    "traces/run.bundle.partial/manifest.json",
    "traces/run.bundle.replay/20260101-000000/cpu-1.r0.sig.zst",
    "traces/run.bundle.bisect/report.json",
    "traces/run.bundle.bisect.partial/work/oplog-reference.json",
    "traces/run.bundle.bisect/ticket/repro.py",
    "traces/tiny-llama.bundle/manifest.json",  # `record builtin:tiny-llama`'s default --out
    "traces/job.bundle.logs/20261201-120000-1234-abcdef/record-rank0.stderr.txt",
    "traces/walkthrough-ledger.sqlite",  # the walkthrough's own ledger (SDCREPLAY_LEDGER)
    "traces/walkthrough-ledger.sqlite-wal",
    "traces/corpus/corpus.json",
    "traces/spread.png",
]


def _ignored(path: str) -> bool:
    done = subprocess.run(
        ["git", "check-ignore", "-q", "--no-index", path], cwd=REPO, capture_output=True
    )
    return done.returncode == 0


@pytest.mark.skipif(
    shutil.which("git") is None or not (REPO / ".git").exists(), reason="not a git checkout"
)
def test_the_walkthroughs_files_are_ignored_and_the_checked_in_bundle_is_not():
    assert [path for path in WRITTEN if not _ignored(path)] == []
    assert not _ignored("traces/tiny.bundle/manifest.json")
    assert not _ignored("sdcreplay/cli/app.py")
