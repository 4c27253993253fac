"""The ticket directory: repro.py runs where only torch and h5py exist, inputs.h5 keeps
dtypes, shapes and strides, ticket.json/ticket.md say what a vendor needs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from importlib import metadata
from pathlib import Path

import h5py
import pytest
import torch
from conftest import preserved_global_state
from test_minimize import MODULE, STICKY

from sdcreplay import determinism
from sdcreplay.bisect import bisect
from sdcreplay.capture import CallSite
from sdcreplay.errors import SdcReplayError
from sdcreplay.minimize import minimize
from sdcreplay.operator_case import OperatorCase
from sdcreplay.templates import repro
from sdcreplay.tensorio import raw_bits
from sdcreplay.ticket import device_identity, write_ticket

TRIALS = 200


@pytest.fixture(scope="session")
def ticket(tmp_path_factory: pytest.TempPathFactory, _small_bundle_template: Path) -> Path:
    """The whole story once: bisect a recorded tiny-llama step with a sticky bitflip on cpu:1, then minimize."""
    report = tmp_path_factory.mktemp("ticket") / "report"
    with preserved_global_state(), pytest.MonkeyPatch.context() as patch:
        patch.delenv("SDCREPLAY_INJECT", raising=False)
        found = bisect(_small_bundle_template, suspect="cpu:1", reference="cpu:0", step=1, inject=[STICKY], out=report)
        assert (found.to_json()["op"], found.to_json()["module"]) == ("aten.mm.default", MODULE)
        return Path(minimize(report, trials=TRIALS, inject=[STICKY]).to_json()["ticket"])


def _distribution_closure(names: list[str]) -> set[str]:
    """These distributions and everything they require (extras aside)."""
    found, queue = set(), list(names)
    while queue:
        name = re.split(r"[^A-Za-z0-9._-]", queue.pop())[0].lower().replace("_", "-")
        if name in found:
            continue
        try:
            requires = metadata.distribution(name).requires or []
        except metadata.PackageNotFoundError:
            continue
        found.add(name)
        queue += [requirement for requirement in requires if "extra ==" not in requirement]
    return found


@pytest.fixture(scope="session")
def only_torch_and_h5py(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """An environment for ``python -S`` whose path holds torch, h5py and their requirements only."""
    directory = tmp_path_factory.mktemp("only-torch-h5py")
    for name in _distribution_closure(["torch", "h5py"]):
        distribution = metadata.distribution(name)
        for top in {Path(str(file)).parts[0] for file in distribution.files or []}:
            source = Path(distribution.locate_file(top))
            if top.endswith(".dist-info") or top in ("..", "__pycache__") or not source.exists():
                continue
            if not (directory / top).exists():
                (directory / top).symlink_to(source)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SDCREPLAY")}, "PYTHONPATH": str(directory)}


def test_repro_runs_where_only_torch_and_h5py_are_importable(ticket: Path, only_torch_and_h5py: dict):
    isolated = [sys.executable, "-S"]
    probe = subprocess.run([*isolated, "-c", "import sdcreplay"], env=only_torch_and_h5py, cwd=ticket,
                           capture_output=True, text=True)
    assert probe.returncode != 0 and "No module named 'sdcreplay'" in probe.stderr
    run = subprocess.run([*isolated, "repro.py", "--device", "cpu:1", "--trials", str(TRIALS)],
                         env=only_torch_and_h5py, cwd=ticket, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"failed 0 of {TRIALS}" in run.stdout


def test_repro_applies_sdcreplay_inject_when_sdcreplay_is_importable(ticket: Path):
    env = {**os.environ, "SDCREPLAY_INJECT": STICKY}
    run = subprocess.run([sys.executable, "repro.py", "--device", "cpu:1", "--trials", "50"], env=env, cwd=ticket,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 1, run.stderr
    assert "failed 50 of 50" in run.stdout
    assert "first failure at trial 1: output 0, element 5 (position [0, 5])" in run.stdout
    assert "XOR mask 0x00400000" in run.stdout


def test_ticket_json_and_markdown_say_what_a_vendor_needs(ticket: Path):
    doc = json.loads((ticket / "ticket.json").read_text())
    assert doc["schema"] == "sdcreplay.ticket/1" and doc["status"] == "reproduced"
    assert doc["drill"] is True and doc["injected_faults"] == [STICKY]
    assert doc["device"]["label"] == "cpu:1" and doc["device"]["name"]
    assert doc["software"]["torch"] == torch.__version__
    assert doc["operator"]["op"] == "aten.mm.default" and doc["operator"]["dtypes"] == ["float32", "float32"]
    assert doc["shapes"]["original"] == [[16, 32], [32, 32]] and doc["shapes"]["minimal"] == [[1, 1], [1, 6]]
    assert (doc["rate"]["failures"], doc["rate"]["trials"], doc["rate"]["ci95"][1]) == (TRIALS, TRIALS, 1.0)
    assert doc["acceptance"] == {"good_trials": 10, "bad_trials": 1}
    assert doc["data_dependent"] is False
    assert doc["first_mismatch"]["index"] == 5 and doc["first_mismatch"]["xor"] == "00400000"
    assert doc["bits"]["histogram"] == {"22": 1}
    assert len(doc["commands"]) == 2 and doc["commands"][1].startswith("sdcreplay minimize")
    assert doc["bisect"]["module"] == MODULE and doc["bisect"]["isolated"] == "kernel"
    markdown = (ticket / "ticket.md").read_text()
    assert f"failed {TRIALS} of {TRIALS} trials" in markdown.splitlines()[0]
    assert "**Drill:**" in markdown and "python repro.py --device cpu:1 --trials 1000" in markdown and "XOR mask 0x00400000" in markdown


def test_inputs_keep_dtype_shape_and_strides(tmp_path: Path):
    left = torch.randn(3, 4).to(torch.bfloat16)
    right = torch.randn(5, 4).to(torch.bfloat16).t()  # a transposed operand, as nn.Linear passes it
    site = CallSite(0, "forward", "proj", "aten.mm.default", 7)
    out = torch.mm(left, right)
    case = OperatorCase(site, Counter({("aten.mm.default", "proj", "forward"): 2}), (left, right), {}, [out], [out])
    result = {"switches": determinism.current_switches(), "device": "cpu:1", "reference": "cpu:0", "reproduced": False,
              "inject": [], "op": "aten.mm.default", "trials": 0, "failures": 0, "rate": 0.0, "ci95": [0.0, 1.0],
              "trials_to_first_failure": None, "kernels": [], "dtypes": ["bfloat16", "bfloat16"], "site": {
                  "step": 0, "phase": "forward", "module": "proj", "index": 7},
              "input_shapes_original": [[3, 4], [4, 5]], "input_shapes_minimal": [[3, 4], [4, 5]],
              "shrink": {"status": "not reproduced"}, "minimal": None, "reference_trials": 0, "reference_failures": 0,
              "acceptance": {"good_trials": 10, "bad_trials": 1}, "data_dependent": None, "first_mismatch": None,
              "bits": None, "pattern": None, "commands": []}
    target = write_ticket(tmp_path / "ticket", result, {}, case)
    with h5py.File(target / "inputs.h5") as handle:
        inputs = repro.read_tree(handle["reference_inputs"])
        expected = repro.read_tree(handle["reference_outputs"])
        assert handle.attrs["op"] == "aten.mm.default"
    for original, read in zip((left, right), inputs["args"], strict=True):
        assert (read.dtype, read.shape, read.stride()) == (original.dtype, original.shape, original.stride())
        assert torch.equal(raw_bits(read), raw_bits(original))
    assert torch.equal(raw_bits(expected[0]), raw_bits(out))
    assert OperatorCase.read(target / "inputs.h5").prior == case.prior


def test_ticket_never_replaces_a_directory_that_is_not_a_ticket(tmp_path: Path):
    (tmp_path / "keep").mkdir()
    (tmp_path / "keep" / "notes.txt").write_text("mine")
    with pytest.raises(SdcReplayError, match="not a ticket directory"):
        write_ticket(tmp_path / "keep", {}, {}, None)
    assert (tmp_path / "keep" / "notes.txt").read_text() == "mine"


def test_cpu_identity_names_the_model():
    identity = device_identity("cpu:3")
    assert identity["label"] == "cpu:3" and identity["type"] == "cpu" and identity["name"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_identity_from_nvml():
    identity = device_identity("cuda:0")
    assert identity["type"] == "cuda" and identity["uuid"]
    nvml = identity["nvml"]
    if nvml["available"]:
        assert nvml["uuid"].removeprefix("GPU-") == identity["uuid"].removeprefix("GPU-")
        assert nvml["driver"] and "serial" in nvml and "ecc_volatile_uncorrected" in nvml
