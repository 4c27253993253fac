"""Bisect inside compiled code: a user's loop script with a ``torch.compile``d step (CPU
Inductor), recorded in its own process; a fault planted for cpu:1 in one Inductor kernel's
output is named by the kernel's generated name, the ATen operators it fused, the output, the
element and the bit, and the kernel re-run alone still writes it wrong there. A whole model
compiled by the user's loop (tests/compiled_loop.py), and a DDP job's rank, are bisected to the
kernel in tests/recording/test_compiled_loop.py on the bundles recorded there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TESTS

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="CPU Inductor needs g++")


@pytest.fixture(scope="module")
def compiled_bundle(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("compiled")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(TESTS / "compiled_function_loop.py"), "run.bundle", "--steps", "2"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return root / json.loads(done.stdout.splitlines()[-1])["bundle"]


@pytest.fixture(scope="module")
def kernel_listing(compiled_bundle: Path) -> dict:
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    listed = CliRunner().invoke(app, ["ops", str(compiled_bundle), "--step", "1", "--json"])
    assert listed.exit_code == 0, listed.output
    return json.loads(listed.stdout)


def test_ops_lists_the_compiled_steps_kernel_calls_with_ready_specs(kernel_listing):
    kernels = kernel_listing["kernels"]
    assert [(k["index"], k["phase"], k["graph"], k["nth"]) for k in kernels] == [
        (0, "forward", "0_forward", 0),
        (1, "backward", "0_backward", 0),
    ]
    forward = kernels[0]
    assert forward["kernel"].startswith("cpp_fused_")
    assert {"aten.gelu", "aten.sigmoid", "aten.mul", "aten.add"} <= set(forward["fused"])
    assert forward["outputs"] == [
        {"shape": [16], "dtype": "float32"},
        {"shape": [4, 16], "dtype": "float32"},
    ]
    assert forward["spec"] == (
        f"kind=bitflip,kernel={forward['kernel']},phase=forward,step=1,nth=0"
    )
    # the ATen calls outside the compiled code are listed as before
    assert any(call["op"] == "aten.mm.default" for call in kernel_listing["calls"])


def test_compiled_code_stays_compiled_under_the_operator_mode(kernel_listing):
    """docs/compiled.md: under ops' OperatorMode Dynamo does not fall back to eager, so no
    operator the generated kernels fused is called as an operator of its own."""
    fused = {op for kernel in kernel_listing["kernels"] for op in kernel["fused"]}
    assert {"aten.gelu", "aten.sigmoid"} <= fused
    called = {call["op"].rsplit(".", 1)[0] for call in kernel_listing["calls"]}
    assert not called & {"aten.gelu", "aten.sigmoid", "aten.gelu_backward"}


@pytest.fixture(scope="module")
def kernel_report(compiled_bundle, kernel_listing, tmp_path_factory) -> tuple[Path, str, dict]:
    """One bisect of the fault planted in the forward kernel's second output, for cpu:1."""
    from typer.testing import CliRunner

    from sdcreplay.cli import app

    spec = kernel_listing["kernels"][0]["spec"] + ",output=1,index=37,bit=27,device=cpu:1"
    out = tmp_path_factory.mktemp("report") / "r.bisect"
    found = CliRunner().invoke(
        app,
        [
            "bisect", str(compiled_bundle), "--suspect", "cpu:1", "--reference", "cpu:0",
            "--inject", spec, "--out", str(out), "--json",
        ],
    )  # fmt: skip
    assert found.exit_code == 1, found.output
    return out, spec, json.loads(found.stdout)


def test_bisect_names_the_kernel_its_fused_ops_the_element_and_the_bit(
    kernel_report, kernel_listing
):
    out, _, report = kernel_report
    forward = kernel_listing["kernels"][0]
    assert (report["verdict"], report["step"], report["level"]) == ("divergence", 1, "kernel")
    assert (report["phase"], report["module"]) == ("forward", "<root>")
    kernel = report["kernel"]
    assert (kernel["name"], kernel["index"], kernel["nth"]) == (forward["kernel"], 0, 0)
    assert kernel["fused"] == forward["fused"]
    assert report["output_index"] == 1
    assert report["elements"]["indices"] == [37] and report["elements"]["positions"] == [[2, 5]]
    assert report["bits"]["histogram"] == {"27": 1}
    assert report["elements"]["xor"] == ["08000000"]
    assert report["isolated"] == "kernel" and report["inputs_match_reference"] is True
    assert report["isolation"]["failures"] == report["isolation"]["runs"] == 3
    assert (out / "kernel.h5").is_file()


def test_minimize_measures_the_kernel_alone_and_its_ticket_runs_it_standalone(
    kernel_report, cli, tmp_path
):
    out, spec, report = kernel_report
    ticket = tmp_path / "ticket"
    measured = cli("minimize", out, "--inject", spec, "--trials", "20", "--out", ticket, "--json")
    assert measured.exit_code == 1, measured.output
    result = json.loads(measured.stdout)
    assert (result["level"], result["kernel"]["name"]) == ("kernel", report["kernel"]["name"])
    assert (result["failures"], result["trials"], result["reference_failures"]) == (20, 20, 0)
    assert result["kernel"]["fused"] == report["kernel"]["fused"]
    source = (ticket / "kernel.cpp").read_text()
    assert 'extern "C"' in source and "void  kernel(" in source
    assert report["kernel"]["name"] in (ticket / "ticket.md").read_text()
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("SDCREPLAY_INJECT", None)
    clean = subprocess.run(
        [sys.executable, "repro.py", "--device", "cpu", "--trials", "5"],
        cwd=ticket, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert clean.returncode == 0, clean.stdout + clean.stderr[-2000:]
    assert "failed 0 of 5" in clean.stdout
    drill = subprocess.run(
        [sys.executable, "repro.py", "--device", "cpu:1", "--trials", "5"],
        cwd=ticket, env={**env, "SDCREPLAY_INJECT": spec}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert drill.returncode == 1, drill.stdout + drill.stderr[-2000:]
    assert "failed 5 of 5" in drill.stdout and "XOR mask 0x08000000" in drill.stdout
