"""A replay depends only on the bundle and the command typed (issue 39, items 1 and 2).

tests/env_script.py is a script-mode loop whose step follows its environment, as an
Accelerate loop does (``ACCELERATE_MIXED_PRECISION=bf16``: a bfloat16 forward) and with a
variable of its own (``MYAPP_SCALE`` scales the loss). Recorded with both set, it either
replays `correct` whoever replays it (the launcher's variable kept by default, its own kept
with ``Recorder(env=["MYAPP_*"])``), or is refused while recording with the variable named,
since the first-step check replays in a fresh process with the bundle's environment alone.
It is never left to say `recording_suspect` about a healthy device.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdcreplay import Recorder
from sdcreplay.bundle.reader import Bundle
from sdcreplay.capture import environment
from sdcreplay.errors import SdcReplayError, WorkloadMismatchError
from sdcreplay.recording.verification import VERIFY_DEVICE_ENV
from tests.conftest import TESTS, tiny_llama_recorder

SCRIPT = TESTS / "env_script.py"
DEVICES = ["-d", "cpu:0", "-d", "cpu:1"]
RECORDED_WITH = {"ACCELERATE_MIXED_PRECISION": "bf16", "MYAPP_SCALE": "3"}
NO_LEDGER = {"SDCREPLAY_LEDGER": "off"}


def _record(folder: Path, *options: str) -> tuple[Path, subprocess.CompletedProcess]:
    """``python env_script.py run.bundle OPTIONS`` in ``folder``, with `RECORDED_WITH` set."""
    bundle = folder / "run.bundle"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(bundle), *options],
        cwd=folder,
        env={**os.environ, **RECORDED_WITH},
        capture_output=True,
        text=True,
        timeout=600,
    )
    return bundle, done


def _verdicts(cli, bundle: Path, shell: dict) -> tuple[str, list, list]:
    """The consensus, each device's verdict and the shell's ignored variables (each also a
    warning on stderr) of `replay --json` run from ``shell``."""
    done = cli("replay", bundle, *DEVICES, "--json", env={**NO_LEDGER, **shell})
    report = json.loads(done.stdout)
    devices = [(d["device"], d["verdict"]) for d in report["devices"]]
    warned = [
        line.removeprefix("Warning: not passed to the replay (the bundle's environment is): ")
        for line in done.stderr.splitlines()
        if line.startswith("Warning: not passed")
    ]
    assert warned == report["ignored_environment"]
    return report["consensus"]["verdict"], devices, report["ignored_environment"]


def test_what_a_bundle_keeps_and_what_a_device_process_inherits():
    shell = {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "OMP_NUM_THREADS": "4",
        "MYAPP_SCALE": "3",
        "HF_TOKEN": "hf_x",
        "MYAPP_API_KEY": "k",
        "MKL_CBWR": "COMPATIBLE",  # determinism.py's: inherited and judged by the fingerprint
        "CUDA_VISIBLE_DEVICES": "1",
        "PATH": "/bin",
        "SDCREPLAY_LEDGER": "off",
        "UNRELATED": "x",
    }
    assert environment.recorded(shell) == {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "OMP_NUM_THREADS": "4",
    }
    assert environment.recorded(shell, ("MYAPP_*",)) == {
        "ACCELERATE_MIXED_PRECISION": "bf16",
        "MYAPP_SCALE": "3",
        "OMP_NUM_THREADS": "4",
    }  # never a secret, whatever pattern names it
    assert environment.inherited(shell) == {
        "MKL_CBWR": "COMPATIBLE",
        "CUDA_VISIBLE_DEVICES": "1",
        "PATH": "/bin",
        "SDCREPLAY_LEDGER": "off",
    }
    kept = {"ACCELERATE_MIXED_PRECISION": "fp16", "OMP_NUM_THREADS": "4"}
    assert environment.ignored(shell, kept, ("MYAPP_*",)) == [
        "ACCELERATE_MIXED_PRECISION='bf16' here, 'fp16' in the bundle",
        "MYAPP_SCALE='3' here, unset in the recording",
    ]
    assert "UNRELATED" in environment.unkept(shell, kept)
    assert "HF_TOKEN" not in environment.unkept(shell, kept)


def test_a_recorder_refuses_a_secret_a_malformed_pattern_and_env_beside_a_factory():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(SdcReplayError, match="env= names WANDB_API_KEY, a secret"):
        Recorder("x.bundle", model=model, optimizer=optimizer, env=["WANDB_API_KEY"])
    with pytest.raises(SdcReplayError, match="not 'MY APP'"):
        Recorder("x.bundle", model=model, optimizer=optimizer, env=["MY APP"])
    with pytest.raises(SdcReplayError, match="a workload= factory"):
        Recorder("x.bundle", "builtin:tiny-llama", model, optimizer, env=["MYAPP_*"])
    assert not Path("x.bundle").exists() and not Path("x.bundle.partial").exists()


@pytest.mark.slow
def test_a_kept_environment_replays_correct_from_any_shell(tmp_path, cli):
    bundle, done = _record(tmp_path, "--keep")
    assert done.returncode == 0, done.stderr[-3000:]
    opened = Bundle.open(bundle)
    assert opened.verified and opened.probe()["calls"]  # the fresh process's probe came back
    command = opened.manifest.workload.command
    assert command["env"]["ACCELERATE_MIXED_PRECISION"] == "bf16"  # a launcher's: kept anyway
    assert command["env"]["MYAPP_SCALE"] == "3"  # the loop's own: kept by env=
    assert command["env_watched"] == ["MYAPP_*"]

    plain = {"ACCELERATE_MIXED_PRECISION": None, "MYAPP_SCALE": None}
    other = {"ACCELERATE_MIXED_PRECISION": "no", "MYAPP_SCALE": "5"}
    correct = ("correct", [("cpu:0", "match"), ("cpu:1", "match")])
    assert _verdicts(cli, bundle, plain) == (*correct, [])
    assert _verdicts(cli, bundle, other) == (
        *correct,
        [
            "ACCELERATE_MIXED_PRECISION='no' here, 'bf16' in the bundle",
            "MYAPP_SCALE='5' here, '3' in the bundle",
        ],
    )


@pytest.mark.slow
def test_a_variable_the_bundle_does_not_keep_is_named_at_record_never_accusing_a_device(
    tmp_path, cli
):
    """The check ran inside the recording process, where MYAPP_SCALE was set, and passed; a
    replay then said recording_suspect. In a fresh process it finds the difference."""
    (tmp_path / "strict").mkdir()
    strict, done = _record(tmp_path / "strict")
    assert done.returncode != 0
    assert "WorkloadMismatchError: the workload cannot replay this recording" in done.stderr
    assert "the bundle does not keep: " in done.stderr and "MYAPP_SCALE" in done.stderr
    assert not strict.exists()

    (tmp_path / "warn").mkdir()
    warned, done = _record(tmp_path / "warn", "--warn")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "UserWarning: the workload cannot replay this recording" in done.stderr
    opened = Bundle.open(warned)
    assert opened.verification.status == "failed"
    assert "MYAPP_SCALE" in opened.verification.problem
    verdict, devices, _ = _verdicts(cli, warned, {"MYAPP_SCALE": "3"})
    assert verdict != "recording_suspect" and devices == [("cpu:0", "match"), ("cpu:1", "match")]


@pytest.mark.slow
def test_an_accelerate_bf16_launch_replays_correct_from_a_plain_shell(tmp_path, cli):
    """`accelerate launch --mixed_precision bf16` says bf16 in ACCELERATE_MIXED_PRECISION
    alone: the bundle kept only code-selecting variables, so its replicas trained in fp32 and
    accused the recording device (recording_suspect)."""
    pytest.importorskip("accelerate")
    launcher = Path(sys.executable).parent / "accelerate"
    bundle = tmp_path / "run.bundle"
    done = subprocess.run(
        [
            launcher, "launch", "--num_processes", "1", "--num_machines", "1",
            "--mixed_precision", "bf16", "--dynamo_backend", "no", "--cpu",
            TESTS / "accelerate_loop.py", bundle,
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    opened = Bundle.open(bundle)
    assert opened.verified
    assert opened.manifest.workload.command["env"]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    plain = {name: None for name in os.environ if name.startswith("ACCELERATE_")}
    assert _verdicts(cli, bundle, plain) == (
        "correct",
        [("cpu:0", "match"), ("cpu:1", "match")],
        [],
    )


def _two_steps(path: Path) -> Path:
    workload, rec = tiny_llama_recorder(path)
    for index in range(2):
        batch = workload.get_batch(index)
        with rec.step(batch):
            workload.loss_fn(workload.model, batch).backward()
            workload.optimizer.step()
            workload.optimizer.zero_grad()
    return rec.close()


@pytest.mark.slow
def test_the_check_runs_on_the_device_sdcreplay_verify_device_names(tmp_path, monkeypatch):
    """For a GPU without the memory for a second copy: another label (of the same model)."""
    monkeypatch.setenv(VERIFY_DEVICE_ENV, "cpu:5")
    assert Bundle.open(_two_steps(tmp_path / "other.bundle")).verified
    monkeypatch.setenv(VERIFY_DEVICE_ENV, "tpu 9")  # the check cannot run: it never raises
    with pytest.raises(WorkloadMismatchError, match="check could not run: unknown device label"):
        _two_steps(tmp_path / "refused.bundle")  # ... but the strict refusal
