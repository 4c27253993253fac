"""Commands that only orchestrate never import torch in their own process (issue 42).

`--help`, `info`, `diff` of two logs, `devices list`, `corpus add` and the own processes of
`replay` and `screen` read files, start device processes, compare and render: torch (several
seconds of CPU) is imported by the device processes alone. Each command runs in a real
process, through `sdcreplay.cli.main` as the console script runs it, and says whether torch
was imported once it is done.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

STARTUP = """
import sys
sys.argv = ["sdcreplay", *sys.argv[1:]]
from sdcreplay.cli import main
try:
    main()
except SystemExit as exc:
    code = exc.code
print("torch imported" if "torch" in sys.modules else "no torch", code, file=sys.stderr)
"""


def startup(*args: str | Path, env: dict[str, str] | None = None) -> str:
    """The last line the command's process writes: whether it imported torch, its exit code."""
    done = subprocess.run(
        [sys.executable, "-c", STARTUP, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, **(env or {})},
    )
    return done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.stdout


@pytest.fixture(scope="module")
def replayed(_small_bundle_template: Path, tmp_path_factory: pytest.TempPathFactory):
    """The small bundle replayed on cpu:0 and cpu:1 into a ledger of its own: (the replay's
    own process's last line, the log directory, the ledger's environment)."""
    root = tmp_path_factory.mktemp("startup")
    env = {"SDCREPLAY_LEDGER": str(root / "ledger.sqlite")}
    logs = root / "logs"
    args = ("replay", _small_bundle_template, "-d", "cpu:0", "-d", "cpu:1", "--logs", logs)
    return startup(*args, env=env), logs, env


def test_replay_imports_torch_only_in_its_device_processes(replayed):
    line, logs, _ = replayed
    assert line == "no torch 0"
    assert sorted(path.name for path in logs.glob("*.sig.zst")) == [
        "cpu-0.r0.sig.zst",
        "cpu-1.r0.sig.zst",
    ]


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["info", "BUNDLE"],
        ["info", "BUNDLE", "--json"],
        ["diff", "LOGS/cpu-0.r0.sig.zst", "LOGS/cpu-1.r0.sig.zst"],
        ["diff", "BUNDLE", "LOGS/cpu-1.r0.sig.zst", "--json"],
        ["devices", "list"],
    ],
    ids=["help", "info", "info-json", "diff-logs", "diff-bundle-log", "devices-list"],
)
def test_reading_commands_do_not_import_torch(
    args: list[str], replayed, _small_bundle_template: Path
):
    _, logs, env = replayed
    argv = [
        arg.replace("BUNDLE", str(_small_bundle_template)).replace("LOGS", str(logs))
        for arg in args
    ]
    assert startup(*argv, env=env) == "no torch 0"


def test_a_jobs_info_and_diff_do_not_import_torch(ddp_job: tuple[Path, Path]):
    job, _ = ddp_job
    ranks = job / "ranks"
    assert startup("info", job, "--rank", "1") == "no torch 0"
    assert startup("diff", job, job) == "no torch 0"
    # two ranks' logs differ before their reductions (each its own shard of the data): exit 1
    assert startup("diff", ranks / "000000", ranks / "000001") == "no torch 1"


def test_corpus_add_and_screen_import_torch_only_in_the_device_processes(
    tickets: list[Path], tmp_path: Path
):
    env = {"SDCREPLAY_LEDGER": "off"}
    corpus = tmp_path / "corpus"
    assert startup("corpus", "add", corpus, tickets[0], env=env) == "no torch 0"
    assert startup("screen", corpus, "-d", "cpu:0", env=env) == "no torch 0"


BISECT_SERVER = """
import sys
from multiprocessing import forkserver
from sdcreplay.bisect.localize import bisect
from sdcreplay.errors import BundleError
try:
    bisect(sys.argv[1], suspect="cpu:1", ledger=False)
except BundleError:
    pass
print(" ".join(forkserver._forkserver._preload_modules))
"""


def test_a_bisects_server_is_started_at_once_with_every_stages_tasks(tmp_path: Path):
    """One forkserver serves every stage of a bisect: started as the bisect begins (here it then
    refuses a missing bundle), it imports the replay's and the operator-level runs' tasks with
    torch, so that no later stage's processes import them again each."""
    done = subprocess.run(
        [sys.executable, "-c", BISECT_SERVER, str(tmp_path / "missing.bundle")],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.stdout.split() == [
        "sdcreplay.replay.processes",
        "sdcreplay.replay.session",
        "sdcreplay.bisect.tasks",
        "torch._dynamo",
    ], done.stderr
