"""Bisect inside compiled code: a user's loop script with a ``torch.compile``d step (CPU
Inductor), recorded in its own process; a fault planted for cpu:1 in one Inductor kernel's
output is named by the kernel's generated name, the ATen operators it fused, the output, the
element and the bit, and the kernel re-run alone still writes it wrong there."""

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
        [sys.executable, str(TESTS / "compiled_loop.py"), "run.bundle", "--steps", "2"],
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


def test_bisect_names_the_kernel_its_fused_ops_the_element_and_the_bit(
    compiled_bundle, kernel_listing, cli, tmp_path
):
    forward = kernel_listing["kernels"][0]
    spec = forward["spec"] + ",output=1,index=37,bit=27,device=cpu:1"
    found = cli(
        "bisect", compiled_bundle, "--suspect", "cpu:1", "--reference", "cpu:0",
        "--inject", spec, "--out", tmp_path / "r.bisect", "--json",
    )  # fmt: skip
    assert found.exit_code == 1, found.output
    report = json.loads(found.stdout)
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
    assert (tmp_path / "r.bisect" / "kernel.h5").is_file()
