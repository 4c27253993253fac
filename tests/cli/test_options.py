"""What every command checks before it imports torch or starts a device process: its fault
specs (``--inject`` and ``SDCREPLAY_INJECT``) and its device labels. A typo is an Error/Hint
and exit 3 from a process that never loaded torch; an operator name that is no ATen operator
is refused once torch is loaded, before any device process runs; a spec a device process
finds wrong (a bit beyond its output's width) is the only answer, never beside a verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_startup import STARTUP

from sdcreplay.devices import cuda_absent

TYPO = "kind=bitflip,op=aten.mm,phse=forward"


def _startup(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", STARTUP, *argv],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def _commands(bundle: Path, out: Path, *extra: str) -> dict[str, list[str]]:
    return {
        "record": ["record", "builtin:tiny-llama", "--out", str(out / "r.bundle"), *extra],
        "replay": ["replay", str(bundle), "--logs", str(out / "logs"), *extra],
        "bisect": ["bisect", str(bundle), "--suspect", "cpu:1", "--out", str(out / "b"), *extra],
        "minimize": ["minimize", str(out / "no-report"), *extra],
    }


@pytest.mark.parametrize("command", ["record", "replay", "bisect", "minimize"])
def test_a_fault_spec_typo_is_refused_before_torch_loads(
    command: str, small_bundle: Path, tmp_path: Path
):
    done = _startup(*_commands(small_bundle, tmp_path, "--inject", TYPO)[command])
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "no torch 3", done.stderr
    assert lines[0] == f"Error: fault spec '{TYPO}': unknown or malformed part 'phse=forward'"
    assert lines[1].startswith("Hint: Keys: kind, op, kernel, output, param, module, phase, step")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.bundle"]  # nothing written


def test_a_typo_in_sdcreplay_inject_is_refused_the_same(small_bundle: Path, tmp_path: Path):
    env = {**os.environ, "SDCREPLAY_INJECT": f"kind=bitflip,op=aten.mm;{TYPO}"}
    done = _startup(*_commands(small_bundle, tmp_path)["replay"], env=env)
    assert done.stderr.strip().splitlines()[-1] == "no torch 3", done.stderr
    assert "unknown or malformed part 'phse=forward'" in done.stderr


@pytest.mark.skipif(cuda_absent() is None, reason="this machine may have a CUDA device")
@pytest.mark.parametrize(
    "args",
    [
        ["record", "builtin:tiny-llama", "--device", "cuda:0", "--out", "OUT"],
        ["replay", "BUNDLE", "-d", "cpu:0", "-d", "cuda:0"],
        ["bisect", "BUNDLE", "--suspect", "cuda:0"],
        ["bisect", "BUNDLE", "--suspect", "cpu:1", "--reference", "cuda:0"],
        ["ops", "BUNDLE", "--step", "0", "--device", "cuda:0"],
        ["minimize", "REPORT", "--device", "cuda:0"],
        ["doctor", "--device", "cuda:0"],
    ],
    ids=["record", "replay", "bisect", "bisect-reference", "ops", "minimize", "doctor"],
)
def test_a_device_this_machine_cannot_have_is_refused_before_torch_loads(
    args: list[str], small_bundle: Path, tmp_path: Path
):
    names = {
        "BUNDLE": str(small_bundle),
        "REPORT": str(tmp_path / "report"),
        "OUT": str(tmp_path / "r.bundle"),
    }
    done = _startup(*[names.get(arg, arg) for arg in args])
    lines = done.stderr.strip().splitlines()
    assert lines[-1] == "no torch 3", done.stderr
    assert lines[0] == (
        f"Error: device cuda:0 was asked for but this machine has no CUDA device ({cuda_absent()})"
    )
    assert (
        lines[1] == "Hint: Use cpu or virtual replicas cpu:0, cpu:1, ... on a machine without GPUs."
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["small.bundle"]


def test_an_operator_that_does_not_exist_is_refused_before_any_process(
    small_bundle: Path, tmp_path: Path, cli
):
    result = cli(
        "replay", small_bundle, "-d", "cpu:0", "--logs", tmp_path / "logs",
        "--inject", "kind=bitflip,op=aten.mn,step=1",
    )  # fmt: skip
    assert result.exit_code == 3, result.output
    assert "Error: fault spec 'kind=bitflip,op=aten.mn,step=1': op=aten.mn is not an ATen " in (
        result.stderr
    )
    assert "Hint: Closest: " in result.stderr and "aten.min" in result.stderr
    assert not (tmp_path / "logs").exists()  # no device process ran


def test_a_bit_beyond_the_outputs_width_is_the_only_answer(small_bundle: Path, tmp_path, cli):
    """A healthy cpu:0 finishes while cpu:1 finds the spec wrong: no verdict, no "no fault
    fired", no "replay those devices again": the spec's error alone."""
    spec = "kind=bitflip,op=aten.mm,module=layers.0.attn.wq,step=1,bit=40,device=cpu:1"
    result = cli(
        "replay", small_bundle, "-d", "cpu:0", "-d", "cpu:1", "--logs", tmp_path / "logs",
        "--inject", spec, "--json",
    )  # fmt: skip
    assert result.exit_code == 3, result.output
    error = json.loads(result.stdout)  # the error object alone: no verdict beside it
    assert error["kind"] == "FaultSpecError" and error["exit_code"] == 3
    assert error["message"] == "bit 40 does not exist in a 32-bit torch.float32 element"
    lines = result.stderr.strip().splitlines()
    assert lines[-2:] == [
        "Error: bit 40 does not exist in a 32-bit torch.float32 element",
        "Hint: A torch.float32 element has bits 0 to 31: give a smaller bit=, or leave it out "
        "(the top mantissa bit of a float).",
    ]
    assert "Verdict" not in result.stderr and "Warning" not in result.stderr
