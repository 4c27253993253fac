"""Hugging Face Accelerate as it ships, run as a user would: examples/accelerate_train.py (a
GPT-2 from a config, a DataLoader, a warm-up schedule and the AcceleratedOptimizer through
``accelerator.prepare``, ``accumulate``, clipping under ``sync_gradients``) launched by
``accelerate launch`` with ``--mixed_precision bf16`` and as a 2-process DDP job, then
replayed, told apart from a planted fault and bisected from another directory, with relative
paths and a shell that sets none of the launcher's variables.

Each launch used to go wrong: the bf16 bundle replayed in fp32 and accused the healthy
recording device (the launcher's ACCELERATE_MIXED_PRECISION was not in the bundle), the DDP
job's replay could not load its state (no ACCELERATE_USE_CPU: no DDP), a relative --out
failed on every device, and the AcceleratedOptimizer was refused with a traceback."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, json_from_elsewhere

pytestmark = pytest.mark.slow
pytest.importorskip("accelerate")
pytest.importorskip("transformers")

CALL = "kind=bitflip,op=aten.addmm,module=transformer.h.0.mlp.c_fc,phase=forward,step=1,index=3"


def plain_shell() -> dict[str, str]:
    """The investigator's shell: none of the launcher's variables."""
    return {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("ACCELERATE_") and name != "SDCREPLAY_DEBUG"
    }


def launched(root: Path, out: str, *options: str, env: dict | None = None) -> Path:
    """``accelerate launch OPTIONS train.py --out OUT`` in ``root`` (a copy of the example)."""
    root.mkdir()
    shutil.copy(REPO / "examples" / "accelerate_train.py", root / "train.py")
    launcher = Path(sys.executable).parent / "accelerate"
    done = subprocess.run(
        [
            launcher,
            "launch",
            "--num_machines",
            "1",
            "--dynamo_backend",
            "no",
            *options,
            "train.py",
            "--out",
            out,
        ],  # fmt: skip
        cwd=root,
        env={**plain_shell(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root / out


def sdcreplay(elsewhere: Path, *args: str, code: int) -> dict:
    """The console script from another directory, in a plain shell, with --json."""
    return json_from_elsewhere(elsewhere, *args, code=code, env=plain_shell())


def replayed_correct_elsewhere(bundle: Path) -> tuple[Path, str]:
    """A replay on cpu:0 and cpu:1 from a directory beside the launch's, by a relative path, in
    a plain shell: correct, with nothing of the shell ignored. (That directory, the path.)"""
    elsewhere = bundle.parent.parent / "elsewhere"
    elsewhere.mkdir()
    relative = os.path.relpath(bundle, elsewhere)
    replayed = sdcreplay(elsewhere, "replay", relative, "-d", "cpu:0", "-d", "cpu:1", code=0)
    assert (replayed["verdict"], replayed["ignored_environment"]) == ("correct", [])
    return elsewhere, relative


def planted(report: dict) -> tuple:
    """What a bisect named: the step, phase, module, operator, elements and bits of CALL."""
    return (
        report["step"], report["phase"], report["module"], report["op"],
        report["elements"]["indices"], report["bits"]["histogram"],
    )  # fmt: skip


def call_with_bit(bit: int) -> tuple:
    return (1, "forward", "transformer.h.0.mlp.c_fc", "aten.addmm.default", [3], {str(bit): 1})


def test_a_bf16_launch_replays_correct_and_bisects_from_another_directory(tmp_path):
    bundle = launched(
        tmp_path / "run", "run.bundle", "--cpu", "--num_processes", "1", "--mixed_precision",
        "bf16",
    )  # fmt: skip
    elsewhere, relative = replayed_correct_elsewhere(bundle)
    report = sdcreplay(
        elsewhere, "bisect", relative, "--suspect", "cpu:1", "--reference", "cpu:0",
        "--inject", f"{CALL},bit=12,device=cpu:1", "--out", "bis", code=1,
    )  # fmt: skip
    assert planted(report) == call_with_bit(12)
    assert report["start"]["from"] == "saved_state"  # the counter is the Recorder's state
    assert (elsewhere / "bis" / "report.json").is_file()
    assert not list(elsewhere.glob("*.partial"))


def test_a_ddp_launch_replays_correct_names_the_rank_and_bisects_it(tmp_path):
    job = launched(
        tmp_path / "job", "job.bundle", "--multi_gpu", "--num_processes", "2",
        env={"ACCELERATE_USE_CPU": "1"},
    )  # fmt: skip
    elsewhere, relative = replayed_correct_elsewhere(job)
    spec = f"{CALL},bit=20,rank=1"
    faulty = sdcreplay(
        elsewhere, "replay", relative, "-d", "cpu:0", "-d", "cpu:1", "--inject", spec, code=1
    )
    assert faulty["origin_rank"] == 1
    report = sdcreplay(
        elsewhere, "bisect", relative, "--rank", "1", "--suspect", "cpu:1", "--reference",
        "cpu:0", "--step", "1", "--inject", f"{spec},device=cpu:1", "--out", "bis", code=1,
    )  # fmt: skip
    assert report["rank"] == 1
    assert planted(report) == call_with_bit(20)
